"""The scheduler on its own, with programs the test writes: slots join and leave a batched step at any
time, one request's error reaches only that request, a cancelled request frees its slot at once, a
query waits at most one model task (an upload's chunk) behind an upload, and stop() is bounded."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from app.serving.scheduler import DecodeStep, Offload, Scheduler
from app.serving.worker import QueueFull, WorkerStopped
from blend.driver import Driver


class Row:
    """A fake cache: the tokens appended to it, and whether decoding it must fail."""

    def __init__(self, name: str, poison: bool = False):
        self.name, self.poison, self.tokens = name, poison, []


class Decoder:
    """decode_step for Rows: logits = the row's token + 1 (so each row counts up on its own). As the real step, a
    step that fails moves no row on."""

    def __init__(self, step_s: float = 0.01):
        self.batches: list[list[str]] = []
        self.spans: list[tuple[float, float]] = []  # (start, end) of each step, time.monotonic()
        self.step_s = step_s

    def __call__(self, caches, tokens, positions):
        self.batches.append([c.name for c in caches])
        start = time.monotonic()
        time.sleep(self.step_s)  # a forward takes time: requests arriving meanwhile join the next step
        self.spans.append((start, time.monotonic()))
        if any(c.poison for c in caches):
            raise RuntimeError("corrupt row")
        for cache, token in zip(caches, tokens):
            cache.tokens.append(token)
        return [token + 1 for token in tokens]


def counting(name: str, n: int, *, first: int = 0, poison: bool = False, prefill_slices: int = 0, log=None,
             slice_s: float = 0.0, slice_times=None):
    """A program: some prefill slices (each taking `slice_s`; their end times go to `slice_times`), then n
    tokens counting up from `first`, one decode step each."""
    def program(cancelled):
        cache, token = Row(name, poison), first
        for _ in range(prefill_slices):
            time.sleep(slice_s)
            if log is not None:
                log.append(("slice", name))
            if slice_times is not None:
                slice_times.append(time.monotonic())
            yield None
        for step in range(n):
            yield f"{name}:{token}"
            if step + 1 < n:
                token = yield DecodeStep(cache, token, len(cache.tokens))
        yield f"{name}:done"
    return program


async def collect(job) -> list:
    await job.wait_started(30)
    items = []
    try:
        async for item in job:
            items.append(item)
    except Exception as exc:
        items.append(exc)
    return items


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


@pytest.fixture
def decoder():
    return Decoder()


def make(decoder, **options) -> Scheduler:
    scheduler = Scheduler(decoder, **{"max_batch": 4, "queue_size": 8, **options})
    scheduler.start()
    return scheduler


def test_requests_joining_and_leaving_each_get_their_own_tokens(decoder):
    scheduler = make(decoder)

    async def main():
        jobs = []
        for name, n, first in [("a", 8, 0), ("b", 3, 100), ("c", 6, 200)]:
            jobs.append(asyncio.create_task(collect(scheduler.submit(counting(name, n, first=first)))))
            await asyncio.sleep(0.01)
        return await asyncio.gather(*jobs)

    a, b, c = run(main())
    assert scheduler.stop()
    assert a == [f"a:{i}" for i in range(8)] + ["a:done"]
    assert b == [f"b:{100 + i}" for i in range(3)] + ["b:done"]
    assert c == [f"c:{200 + i}" for i in range(6)] + ["c:done"]
    assert max(len(batch) for batch in decoder.batches) >= 2  # shared steps
    assert sum(len(batch) for batch in decoder.batches) == 7 + 2 + 5  # one row per token after the first


def stream_and_join(max_stall_s: float, slices: int, slice_s: float):
    """Stream "a" (80 tokens, 40 ms steps); once it decodes, "b" joins with `slices` prefill slices.
    Returns the decoder and the times b's slices ended."""
    decoder, slice_times = Decoder(step_s=0.04), []
    scheduler = make(decoder, slice_s=0.001, max_stall_s=max_stall_s)

    async def main():
        streaming = asyncio.create_task(collect(scheduler.submit(counting("a", 80))))
        await asyncio.sleep(0.2)  # "a" is decoding
        joining = collect(scheduler.submit(counting("b", 4, prefill_slices=slices, slice_s=slice_s,
                                                    slice_times=slice_times)))
        return await asyncio.gather(streaming, joining)

    a, b = run(main())
    assert scheduler.stop()
    assert a[-1] == "a:done" and b[-1] == "b:done"
    assert any(len(batch) == 2 for batch in decoder.batches)  # b joined a's steps
    return decoder, slice_times


def test_a_prefill_runs_before_the_streams_next_token_when_it_fits_the_stall_bound():
    """Prefill first: b's whole prefill (0.3 s) runs between two of a's steps, not a slice per token."""
    decoder, slice_times = stream_and_join(max_stall_s=2.0, slices=60, slice_s=0.005)
    first, last = slice_times[0], slice_times[-1]
    assert not [span for span in decoder.spans if first <= span[0] <= last]


def test_a_long_prefill_is_cut_so_streams_wait_at_most_the_stall_bound():
    """A prefill longer than max_stall_s runs in slices of about max_stall_s less a step, a step after each."""
    max_stall_s, slice_s = 0.15, 0.01
    decoder, slice_times = stream_and_join(max_stall_s=max_stall_s, slices=60, slice_s=slice_s)
    first, last = slice_times[0], slice_times[-1]
    during = [span for span in decoder.spans if first <= span[0] <= last]  # a's steps amid b's prefill
    assert len(during) >= 2
    # Each step starts at least max_stall_s after the one before (the slice fills the stall bound) ...
    for before, after in zip(during, during[1:]):
        assert after[0] - before[0] >= 0.95 * max_stall_s, (before, after)
    # ... and no more of b's slices run between two steps than fit in that bound (a slow machine fits fewer).
    ends = [end for _, end in during]
    most = int(max_stall_s / slice_s) + 1
    for before, after in zip(ends, ends[1:]):
        assert sum(1 for t in slice_times if before <= t <= after) <= most


@pytest.mark.parametrize("slice_s", [0.001, 5.0])
def test_a_short_request_sent_during_a_long_prefill_gets_its_first_token_first(decoder, slice_s):
    """Least served first: the long prefill (200 slices) started first, yet the short one's prefill runs in
    the next slice and its first token comes out before the long one's (order, not wall-clock). With a slice
    budget longer than the whole long prefill (5 s), the long one's slice ends at the piece of work where the
    short one is ready."""
    scheduler, log, firsts = make(decoder, slice_s=slice_s), [], []

    async def main():
        async def first_token(job, name):
            await job.wait_started(30)
            async for _ in job:
                firsts.append(name)
                break
            async for _ in job:
                pass
        long = asyncio.create_task(first_token(scheduler.submit(counting("long", 3, prefill_slices=200,
                                                                         slice_s=0.002, log=log)), "long"))
        while ("slice", "long") not in log:
            await asyncio.sleep(0.005)
        short = first_token(scheduler.submit(counting("short", 3, prefill_slices=3, slice_s=0.002, log=log)),
                            "short")
        await asyncio.gather(long, short)

    run(main())
    assert scheduler.stop()
    assert firsts == ["short", "long"]
    last_short = max(i for i, entry in enumerate(log) if entry == ("slice", "short"))
    assert sum(1 for entry in log[:last_short] if entry == ("slice", "long")) < 100  # long's prefill went on after


def test_with_chunked_prefill_a_short_request_is_answered_inside_the_long_prompts_first_layer(decoder):
    """Chunked prefill (real Blender, tiny model, chunks of 8): the long prompt's first layer is 8 slices. A short
    request sent after the first of them runs its whole prefill, and its first token is chosen, before the long
    prompt's first layer is done (order of events; with whole layers as slices, the layer ends first)."""
    from blend import Blender
    from tests.blend.conftest import random_ids, tiny_model

    blender = Blender(tiny_model("llama"), tokenizer=None, fingerprint="tiny-llama", chunk_tokens=8)
    log, sent = [], threading.Event()

    def prefill(name: str, ids: list[int]):
        slices_per_layer = -(-len(ids) // blender.chunk_tokens)

        def program(cancelled):
            steps, slices = blender.prefill_steps([], ids, 1.0), 0
            while True:
                try:
                    next(steps)
                except StopIteration as done:
                    log.append((name, "first token", int(done.value.logits.argmax())))
                    yield name
                    return
                slices += 1
                if slices % slices_per_layer == 0:
                    log.append((name, "layer done"))
                if name == "long" and slices == 1:
                    log.append((name, "first slice"))
                    sent.wait(30)  # the short request comes while the long prompt's first layer is under way
                yield None
        return program

    scheduler = make(decoder, slice_s=0.0001)

    async def main():
        long = asyncio.create_task(collect(scheduler.submit(prefill("long", random_ids(64, 1)))))
        while ("long", "first slice") not in log:
            await asyncio.sleep(0.005)
        short = scheduler.submit(prefill("short", random_ids(6, 2)))
        sent.set()
        return await asyncio.gather(long, collect(short))

    assert run(main()) == [["long"], ["short"]]
    assert scheduler.stop()
    events = [entry[:2] for entry in log]
    assert events.index(("short", "first token")) < events.index(("long", "layer done")), events


def test_max_batch_bounds_the_slots_and_the_queue_bounds_the_wait(decoder):
    scheduler = make(decoder, max_batch=2, queue_size=1)
    gate = threading.Event()

    def held(cancelled):
        assert gate.wait(30)
        yield "held"

    async def main():
        first = scheduler.submit(held)
        await first.wait_started(10)
        second = scheduler.submit(counting("x", 2))  # a free slot, but the model thread is held: it waits
        with pytest.raises(QueueFull):
            scheduler.submit(counting("y", 2))
        gate.set()
        return await collect(second)

    assert run(main()) == ["x:0", "x:1", "x:done"]
    assert scheduler.stop()
    assert all(len(batch) <= 2 for batch in decoder.batches)


def test_an_error_reaches_only_its_request(decoder):
    """A program that raises, and a row whose decode step raises (the batch is retried row by row):
    the other requests' tokens are exactly those they get alone."""
    scheduler = make(decoder)

    def broken(cancelled):
        yield "broken:0"
        yield None
        raise ValueError("bad input")

    async def main():
        jobs = [scheduler.submit(counting("a", 6)), scheduler.submit(broken),
                scheduler.submit(counting("p", 6, poison=True)), scheduler.submit(counting("b", 5, first=50))]
        return await asyncio.gather(*(collect(j) for j in jobs))

    a, bad, poisoned, b = run(main())
    assert scheduler.stop()
    assert a == [f"a:{i}" for i in range(6)] + ["a:done"]
    assert b == [f"b:{50 + i}" for i in range(5)] + ["b:done"]
    assert bad[0] == "broken:0" and isinstance(bad[-1], ValueError)
    assert poisoned[0] == "p:0" and isinstance(poisoned[-1], RuntimeError) and len(poisoned) == 2


def test_a_cancelled_request_frees_its_slot_at_once(decoder):
    scheduler = make(decoder, max_batch=2)
    closed = threading.Event()

    def endless(cancelled):
        cache, token = Row("e"), 0
        try:
            while True:
                yield f"e:{token}"
                token = yield DecodeStep(cache, token, len(cache.tokens))
        finally:
            closed.set()

    async def main():
        job = scheduler.submit(endless)
        await job.wait_started(10)
        seen = 0
        async for _ in job:
            seen += 1
            if seen == 5:
                job.cancel()
                break
        other = await collect(scheduler.submit(counting("a", 4)))
        return other

    assert run(main()) == ["a:0", "a:1", "a:2", "a:3", "a:done"]
    assert closed.wait(5) and scheduler.active == 0
    assert scheduler.stop()


def test_a_query_waits_at_most_one_model_task_behind_an_upload(decoder):
    """An upload hands the model thread one chunk at a time; a query arriving meanwhile runs all its
    prefill slices before the next chunk."""
    scheduler = make(decoder)
    timeline: list[tuple[str, str]] = []

    def upload() -> None:
        for i in range(30):
            scheduler.run_on_model(lambda i=i: (timeline.append(("chunk", str(i))), time.sleep(0.02)),
                                   label="upload: chunk")

    async def main():
        thread = threading.Thread(target=upload)
        thread.start()
        while len(timeline) < 5:
            await asyncio.sleep(0.005)
        timeline.append(("submitted", "q"))
        items = await collect(scheduler.submit(counting("q", 3, prefill_slices=10, log=timeline)))
        timeline.append(("answered", "q"))
        await asyncio.to_thread(thread.join)
        return items

    assert run(main())[-1] == "q:done"
    assert scheduler.stop()
    submitted = timeline.index(("submitted", "q"))
    first_slice = timeline.index(("slice", "q"))
    assert sum(1 for kind, _ in timeline[submitted:first_slice] if kind == "chunk") <= 1
    slices = [i for i, event in enumerate(timeline) if event == ("slice", "q")]
    assert not any(kind == "chunk" for kind, _ in timeline[slices[0]:slices[-1]])  # nothing between its slices
    assert sum(1 for kind, _ in timeline if kind == "chunk") == 30  # and the upload finished


def test_offload_runs_off_the_model_thread(decoder):
    scheduler = make(decoder)
    threads = []

    def program(cancelled):
        value = yield Offload(lambda: threads.append(threading.current_thread().name) or 41)
        threads.append(threading.current_thread().name)
        yield value + 1

    async def main():
        return await collect(scheduler.submit(program))

    assert run(main()) == [42]
    assert scheduler.stop()
    assert threads[0].startswith("ragblend-prep") and threads[1] == "ragblend-model"
    # The same program alone, through the same driver, without a scheduler: its offload runs inline
    threads.clear()
    assert list(Driver(decoder).run(program(lambda: False))) == [42]
    assert threads == [threading.current_thread().name] * 2


def test_stop_fails_waiting_work_and_is_bounded(decoder):
    """Waiting requests get WorkerStopped at once, a running one is cancelled after the grace period,
    and nothing new is accepted."""
    scheduler = make(decoder, max_batch=1)
    stopping, during_grace = threading.Event(), []

    def endless(cancelled):
        cache, token = Row("s"), 0
        while True:
            time.sleep(0.01)
            if stopping.is_set():
                during_grace.append(token)
            yield f"s:{token}"
            token = yield DecodeStep(cache, token, len(cache.tokens))

    async def main():
        running = scheduler.submit(endless)
        await running.wait_started(10)
        queued = scheduler.submit(counting("q", 2))
        stopping.set()
        stopped = await asyncio.to_thread(scheduler.stop, 0.3, 5.0)
        with pytest.raises(WorkerStopped):
            await collect_raising(queued)
        with pytest.raises(WorkerStopped):
            scheduler.submit(counting("late", 1))
        return stopped

    # The running request went on during the grace, then was cancelled: the model thread ended.
    assert run(main()) and during_grace
    with pytest.raises(WorkerStopped):
        scheduler.run_on_model(lambda: None, label="late")


async def collect_raising(job):
    await job.wait_started(5)
    return [item async for item in job]
