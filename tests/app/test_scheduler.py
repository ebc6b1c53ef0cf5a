"""The scheduler on its own thread, with request work the test writes: requests join and leave a batched step at
any time, one request's error reaches only that request, a cancelled request frees its slot at once, `prepare`
runs off the model thread, a query waits at most one model task (an upload's chunk) behind an upload, and stop()
is bounded. Which step runs is blend.driver.schedule's (tests/blend/test_driver.py, as a pure function of state);
here the assertions are on what each request gets and on the order of events, never on time."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from app.serving.scheduler import Scheduler, task_due
from app.serving.worker import QueueFull, WorkerStopped
from tests.blend.test_driver import Sequence, Work


class Decoder:
    """DecodeRuntime.advance for the tests' Sequences: each row's next token is its last + 1; `batches` records
    each step's rows (their first tokens); a poisoned row gets its own error."""

    def __init__(self):
        self.batches: list[list[int]] = []

    def __call__(self, sequences):
        self.batches.append([s.tokens[0] for s in sequences])
        rows = []
        for s in sequences:
            if s.poison:
                rows.append(RuntimeError("corrupt row"))
            else:
                s.accept(s.last + 1)
                rows.append(s.last)
        return rows


class Text:
    """An output side: token ids as "n" strings; a stop once `stop_at` is seen."""

    def __init__(self, stop_at: int | None = None):
        self.stop_at, self.stopped = stop_at, False

    def feed(self, item):
        if not isinstance(item, list):
            return [item]
        if self.stopped:
            return []
        self.stopped = self.stop_at in item
        return [str(token) for token in item]


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
    scheduler = Scheduler(decoder, **{"layers": 4, "max_batch": 4, "queue_size": 8, **options})
    scheduler.start()
    return scheduler


def submit(scheduler: Scheduler, work: Work, stop_at: int | None = None):
    return scheduler.submit(lambda: work, label=work.name, output=Text(stop_at))


def counted(first: int, n: int, reason: str = "length", name: str | None = None) -> list:
    return [str(first + i) for i in range(n)] + [f"{name}:{reason}"]


def test_requests_joining_and_leaving_each_get_their_own_tokens(decoder):
    scheduler = Scheduler(decoder, layers=4, max_batch=4, queue_size=8)

    async def main():
        jobs = [asyncio.create_task(collect(submit(scheduler, Work(name, 2, n, first=first))))
                for name, n, first in [("a", 8, 0), ("b", 3, 100), ("c", 6, 200)]]
        scheduler.start()  # all three waiting: the steps they share do not turn on the machine's speed
        return await asyncio.gather(*jobs)

    a, b, c = run(main())
    assert scheduler.stop()
    assert a == counted(0, 8, name="a") and b == counted(100, 3, name="b") and c == counted(200, 6, name="c")
    assert max(len(batch) for batch in decoder.batches) >= 2  # shared steps
    assert sum(len(batch) for batch in decoder.batches) == 7 + 2 + 5  # one row per token after the first


def test_a_stop_from_the_output_side_ends_the_request_with_its_record(decoder):
    """The output saw a stop string at token 3: the model thread ends the request at its next step (its record
    says "stop"); tokens it decoded meanwhile are never shown."""
    scheduler = make(decoder)
    async def main():
        return await collect(submit(scheduler, Work("s", 1, 1000), stop_at=3))

    assert run(main()) == ["0", "1", "2", "3", "s:stop"]
    assert scheduler.stop() and scheduler.active == 0


def test_with_chunked_prefill_a_short_request_is_answered_inside_the_long_prompts_first_layer(decoder):
    """Chunked prefill (real Blender, tiny model, chunks of 8) and the smallest budget (a slice a step): the long
    prompt's first layer is 8 slices. A short request sent after the first of them runs its whole prefill, and
    its first token is chosen, before the long prompt's first layer is done (order of events)."""
    from blend import Blender
    from tests.blend.conftest import random_ids, tiny_model

    blender = Blender(tiny_model("llama"), tokenizer=None, fingerprint="tiny-llama", chunk_tokens=8)
    log, sent = [], threading.Event()

    def prepared(timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while ("short", "prepared") not in log and time.monotonic() < deadline:
            time.sleep(0.001)

    class Prefill(Work):
        def __init__(self, name: str, ids: list[int]):
            super().__init__(name, 0, 1, log=log)
            self.ids = ids

        def prefill(self):
            steps, slices = blender.prefill_steps([], self.ids, 1.0), 0
            per_layer = -(-len(self.ids) // blender.chunk_tokens)
            while True:
                try:
                    cost = next(steps)
                except StopIteration as done:
                    log.append((self.name, "first token"))
                    sequence = Sequence(1)
                    sequence.accept(int(done.value.logits.argmax()))
                    return sequence
                slices += 1
                if slices % per_layer == 0:
                    log.append((self.name, "layer done"))
                if self.name == "long" and slices == 1:
                    log.append((self.name, "first slice"))
                    sent.wait(30)  # the short request comes while the long prompt's first layer is under way
                if self.name == "long" and slices == 2:  # admitted at the last step, its prepare (off the model
                    prepared(30)  # thread) done before the next: the race is the scheduler's choice, not the pool's
                yield cost

    scheduler = make(decoder, layers=blender.num_layers, step_token_budget=1)

    async def main():
        long = asyncio.create_task(collect(submit(scheduler, Prefill("long", random_ids(64, 1)))))
        while ("long", "first slice") not in log:
            await asyncio.sleep(0.005)
        short = submit(scheduler, Prefill("short", random_ids(6, 2)))
        sent.set()
        return await asyncio.gather(long, collect(short))

    long, short = run(main())
    assert long[-1] == "long:length" and short[-1] == "short:length"
    assert scheduler.stop()
    events = [entry[:2] for entry in log]
    assert events.index(("short", "first token")) < events.index(("long", "layer done")), events


class Held(Work):
    """Work whose prefill waits on `gate` (it holds the model thread)."""

    def __init__(self, name: str, gate: threading.Event):
        super().__init__(name, 0, 1)
        self.gate = gate

    def prefill(self):
        assert self.gate.wait(30)
        return (yield from super().prefill())


def test_max_batch_bounds_the_slots_and_the_queue_bounds_the_wait(decoder):
    scheduler = make(decoder, max_batch=2, queue_size=1)
    gate = threading.Event()

    async def main():
        first = submit(scheduler, Held("held", gate))
        await first.wait_started(10)
        second = submit(scheduler, Work("x", 0, 2))  # a free slot, but the model thread is held: it waits
        with pytest.raises(QueueFull):
            submit(scheduler, Work("y", 0, 2))
        gate.set()
        return await collect(second)

    assert run(main()) == counted(0, 2, name="x")
    assert scheduler.stop()
    assert all(len(batch) <= 2 for batch in decoder.batches)


def test_an_error_reaches_only_its_request(decoder):
    """A prepare that raises, a prefill that raises, and a row whose decode step fails: the other requests'
    tokens are exactly those they get alone."""
    scheduler = make(decoder)

    class Unplannable(Work):
        def prepare(self):
            raise ValueError("no such collection")

    async def main():
        jobs = [submit(scheduler, Work("a", 2, 6)), submit(scheduler, Unplannable("u", 1, 3)),
                submit(scheduler, Work("bad", 4, 3, fail_at=2)), submit(scheduler, Work("p", 1, 6, poison=True)),
                submit(scheduler, Work("b", 1, 5, first=50))]
        return await asyncio.gather(*(collect(j) for j in jobs))

    a, unplannable, bad, poisoned, b = run(main())
    assert scheduler.stop()
    assert a == counted(0, 6, name="a") and b == counted(50, 5, name="b")
    assert len(unplannable) == 1 and isinstance(unplannable[0], ValueError)
    assert len(bad) == 1 and isinstance(bad[0], ValueError)
    assert poisoned[0] == "0" and isinstance(poisoned[-1], RuntimeError) and len(poisoned) == 2


def test_a_cancelled_request_frees_its_slot_at_once(decoder):
    scheduler = make(decoder, max_batch=1)
    endless = Work("e", 0, 10**9)

    async def main():
        job = submit(scheduler, endless)
        await job.wait_started(10)
        seen = 0
        async for _ in job:
            seen += 1
            if seen == 5:
                job.cancel()
                break
        return await collect(submit(scheduler, Work("a", 1, 4)))

    assert run(main()) == counted(0, 4, name="a")
    assert scheduler.active == 0
    assert scheduler.stop()


def test_model_tasks_take_their_share_by_state():
    """A model task runs whenever no request uses the model thread; beside requests, once the requests' work
    since the last task is three times its cost (TASK_SHARE 25%)."""
    assert task_due(in_flight=False, work_since=0, last_cost=10**6)
    assert not task_due(in_flight=True, work_since=2999, last_cost=1000)
    assert task_due(in_flight=True, work_since=3000, last_cost=1000)


def test_a_query_waits_at_most_one_model_task_behind_an_upload(decoder):
    """An upload hands the model thread one chunk at a time; a query arriving meanwhile runs its prefill slices
    before the next chunk, and the upload still finishes."""
    scheduler = make(decoder, step_token_budget=10**6)  # the query's whole prefill in one step
    timeline: list[tuple[str, str]] = []

    def upload() -> None:
        for i in range(30):
            scheduler.run_on_model(lambda i=i: timeline.append(("chunk", str(i))), label="upload: chunk", cost=500)

    async def main():
        thread = threading.Thread(target=upload)
        thread.start()
        while len(timeline) < 5:
            await asyncio.sleep(0.001)
        timeline.append(("submitted", "q"))
        items = await collect(submit(scheduler, Work("q", 10, 3, log=timeline)))
        await asyncio.to_thread(thread.join)
        return items

    assert run(main()) == counted(0, 3, name="q")
    assert scheduler.stop()
    submitted = timeline.index(("submitted", "q"))
    slices = [i for i, event in enumerate(timeline) if event == ("q", "slice")]
    assert sum(1 for kind, _ in timeline[submitted:slices[0]] if kind == "chunk") <= 1
    assert not any(kind == "chunk" for kind, _ in timeline[slices[0]:slices[-1]])  # nothing between its slices
    assert sum(1 for kind, _ in timeline if kind == "chunk") == 30  # and the upload finished


def test_prepare_runs_off_the_model_thread(decoder):
    scheduler = make(decoder)
    threads = []

    class Noting(Work):
        def prepare(self):
            threads.append(threading.current_thread().name)

        def prefill(self):
            threads.append(threading.current_thread().name)
            return (yield from super().prefill())

    async def main():
        return await collect(submit(scheduler, Noting("n", 1, 1)))

    assert run(main()) == counted(0, 1, name="n")
    assert scheduler.stop()
    assert threads[0].startswith("ragblend-prep") and threads[1] == "ragblend-model"


def test_stop_fails_waiting_work_and_is_bounded(decoder):
    """Waiting requests get WorkerStopped at once, a running one is cancelled after the grace period,
    and nothing new is accepted."""
    scheduler = make(decoder, max_batch=1)
    endless = Work("s", 0, 10**9)

    async def main():
        running = submit(scheduler, endless)
        await running.wait_started(10)
        queued = submit(scheduler, Work("q", 0, 2))
        stopped = await asyncio.to_thread(scheduler.stop, 0.3, 5.0)
        with pytest.raises(WorkerStopped):
            await collect_raising(queued)
        with pytest.raises(WorkerStopped):
            submit(scheduler, Work("late", 0, 1))
        return stopped

    assert run(main())  # the running request went on during the grace, then was cancelled: the thread ended
    assert len(decoder.batches) > 1
    with pytest.raises(WorkerStopped):
        scheduler.run_on_model(lambda: None, label="late")


async def collect_raising(job):
    await job.wait_started(5)
    return [item async for item in job]
