"""The scheduler: one thread owns the model and interleaves every request's work on it.

A request is a program (RagEngine.program) that blend.driver's Driver steps on the model thread: it yields
text deltas and its result for the client, and directives between them (Offload, None for a slice of model
work, DecodeStep; blend.driver). The Driver does the stepping - advancing a program to its next directive, one
batched decode step for every request waiting on a token, the row-by-row retry of a step that failed; this
module adds what a server needs around it: the model thread, the queue and admission, the offload pool
(`ragblend-prep`), slice budgets, model tasks (other threads hand the model thread whole functions with
`run_on_model`: an upload's chunk precompute), /health and Retry-After.

Each request holds a slot from admission to its last token; at most `max_batch` slots, the decode KV pool's
slots (blend.pool: the server sizes both from server.max_batch; a request takes its pool slot when its
prefill ends and gives it back when its program closes, cancelled or done). The loop:
    1. admit queued requests into free slots; end cancelled ones at once (their slot is free)
    2. run one slice: the least served request that is not decoding (the one whose prefill slices have had
       the least model time so far) advances until it yields or the slice budget is spent; if none needs it,
       one model task may run instead: always when no request is in flight, else only to keep tasks at
       TASK_SHARE of the thread's time (requests before tasks, so a query waits about one chunk's precompute
       behind an upload, and its tokens keep flowing)
    3. one batched decode step for every request waiting on logits, each then resumed with its row
Least served first (least attained service): a request's size is not known ahead, but a new one has had
none, so a short query sent during a long chat's prefill runs its prefill next, and its first token comes
after one chunk of the long one (a slice ends early, at a chunk's end, when a new request waits or is ready;
blend.blender cuts a layer into server.prefill_chunk_tokens chunks), not after all of it; long prefills beside
one another take turns. (Oldest first made a 4-token query wait for a 40-message chat's whole prefill: 94x its
TTFT alone; see BENCHMARKS.)
Prefill first (vLLM's and SGLang's default order): a request still prefilling adds a row to every later
step, so its prefill runs before the streams already answering get their next token, but for at most
`max_stall_s` between two of their tokens (plus the rest of the layer it is in): a long prompt is cut into
slices, one decode step after each.
An error in one request (bad input, a corrupt chunk) ends that request only.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
import time
from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from app.serving.worker import END, Job, QueueFull, WorkerStopped
from blend.decode import DecodeStep
from blend.driver import DecodeFn, Driver, Offload, Program, Slot

__all__ = ["DecodeStep", "Offload", "Scheduler"]
log = logging.getLogger("ragblend.scheduler")

Cancelled = Callable[[], bool]
TASK_SHARE = 0.25  # while requests are in flight, model tasks (upload chunks) get at most this share of the thread


@dataclass(eq=False)
class _Request(Slot):
    """A request's program in its slot, with the job that carries its events to its client."""
    job: Job | None = None
    admitted: float = field(default_factory=time.monotonic)
    served_s: float = 0.0  # model time its prefill slices have had: the next slice goes to the least served
    answered: bool = False  # has reached decoding (its first token is out): no longer waiting

    def cancelled(self) -> bool:
        return self.job.cancelled.is_set()

    @property
    def label(self) -> str:
        return f"request {self.job.label}"


@dataclass(eq=False)
class _Task:
    fn: Callable[[], Any]
    label: str
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    submitted: float = field(default_factory=time.monotonic)


class Scheduler:
    def __init__(self, decode_step: DecodeFn, *, max_batch: int, queue_size: int, slice_s: float = 0.1,
                 max_stall_s: float = 1.5, offload_threads: int = 1):
        self.max_batch, self.queue_size, self.slice_s = max_batch, queue_size, slice_s
        self.max_stall_s = max_stall_s
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()   # guarded by _cond
        self._tasks: deque[_Task] = deque()   # guarded by _cond
        # the requests in flight: the driver's slots, the model thread's own
        self._driver = Driver(decode_step, offload=self._offload_call, on_finish=self._finished)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="ragblend-model", daemon=True)
        self._offload = concurrent.futures.ThreadPoolExecutor(offload_threads, thread_name_prefix="ragblend-prep")
        self._current: tuple[str, float] | None = None  # (what the model thread runs, since when)
        self._decode_steps: Counter[int] = Counter()  # batched steps by their number of rows (step_totals)
        self._decode_seconds: Counter[int] = Counter()  # ... and the seconds they took
        self._request_s = 1.0  # moving average of a request's time in its slot, for Retry-After
        self._next_task_at = 0.0  # while requests are in flight, no model task before this (monotonic)

    # ---- any thread ------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def waiting(self) -> int:
        with self._cond:
            return sum(1 for job in self._waiting if job.waiting)

    @property
    def _slots(self) -> list[_Request]:
        return self._driver.slots

    @property
    def active(self) -> int:
        return len(self._slots)

    def retry_after(self) -> int:
        """Seconds until a slot is likely free for one more waiting request: an estimate for Retry-After."""
        return min(60, max(1, math.ceil(self._request_s * (self.waiting + 1) / self.max_batch)))

    def submit(self, work: Callable[[Cancelled], Program], label: str = "") -> Job:
        """Queue a request (call from the event loop); QueueFull / WorkerStopped if it cannot wait."""
        job = Job(work, asyncio.get_running_loop(), label)
        with self._cond:
            if self._stopping:
                raise WorkerStopped
            self._waiting = deque(j for j in self._waiting if j.waiting)  # forget dropped ones
            if len(self._waiting) >= self.queue_size:
                raise QueueFull
            self._waiting.append(job)
            self._cond.notify()
        return job

    def run_on_model(self, fn: Callable[[], Any], *, label: str, cancelled: Cancelled | None = None) -> Any:
        """Run `fn()` on the model thread between other work and return its result (blocking; never call
        it from the model thread). concurrent.futures.CancelledError if `cancelled()` turns true before
        it started; WorkerStopped if the scheduler stops first."""
        task = self._add_task(fn, label)
        while True:
            try:
                return task.future.result(timeout=0.1)
            except concurrent.futures.TimeoutError:
                if cancelled is not None and cancelled():
                    task.future.cancel()  # a no-op once it runs: then it finishes (one chunk) and we return

    def _add_task(self, fn: Callable[[], Any], label: str) -> _Task:
        task = _Task(fn, label)
        with self._cond:
            if self._stopping:
                raise WorkerStopped
            self._tasks.append(task)
            self._cond.notify()
        return task

    def oldest_wait_s(self) -> float:
        """How long the longest-waiting request has waited for its first token (queued or prefilling)."""
        with self._cond:
            since = [job.submitted for job in self._waiting if job.waiting]
        since += [slot.job.submitted for slot in list(self._slots) if not slot.answered]
        return max((time.monotonic() - t for t in since), default=0.0)

    def snapshot(self) -> dict[str, Any]:
        """The model thread's state, for /health."""
        current = self._current
        with self._cond:
            tasks = len(self._tasks)
        slots = list(self._slots)
        return {
            "alive": self._thread.is_alive(),
            "current": None if current is None else {"work": current[0],
                                                     "age_s": round(time.monotonic() - current[1], 3)},
            "queue_depth": self.waiting,
            "oldest_wait_s": round(self.oldest_wait_s(), 3),
            "active_slots": len(slots),
            "decoding": sum(1 for s in slots if s.state == "decode"),
            "max_batch": self.max_batch,
            "model_tasks_waiting": tasks,
        }

    def step_totals(self) -> dict[int, tuple[int, float]]:
        """Batched decode steps by rows decoded together: (how many, seconds spent in them), for /metrics."""
        steps, seconds = dict(self._decode_steps), dict(self._decode_seconds)  # copies: the model thread adds
        return {rows: (n, seconds.get(rows, 0.0)) for rows, n in steps.items()}

    def busy_s(self) -> float:
        """How long the model thread has been on its current piece of work (0 when idle)."""
        current = self._current
        return 0.0 if current is None else time.monotonic() - current[1]

    def begin_stop(self) -> None:
        """Stop accepting: waiting requests get WorkerStopped, queued model tasks too. Running requests go on."""
        with self._cond:
            self._stopping = True
            waiting, self._waiting = list(self._waiting), deque()
            tasks, self._tasks = list(self._tasks), deque()
            self._cond.notify()
        for job in waiting:
            if job.claim():
                job.post(WorkerStopped())
                job.post(END)
        for task in tasks:
            if task.future.set_running_or_notify_cancel():
                task.future.set_exception(WorkerStopped())

    def cancel_all(self) -> None:
        """Cancel every running request (each ends at its next step)."""
        for slot in list(self._slots):
            slot.job.cancel()
        with self._cond:
            self._cond.notify()

    def stop(self, grace_s: float = 5.0, timeout_s: float = 10.0) -> bool:
        """Stop accepting, let running requests finish for `grace_s`, cancel the rest, end the thread.
        True if the model thread has ended (only then is it safe to close what it uses)."""
        self.begin_stop()
        deadline = time.monotonic() + grace_s
        while self._slots and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.05)
        self.cancel_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._offload.shutdown(wait=False, cancel_futures=True)
        return not self._thread.is_alive()

    # ---- the model thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                self._admit()
                if self._stopping and not self._slots and not self._tasks:
                    return
                if not self._runnable():
                    self._cond.wait(self._idle_wait())
                    continue
            try:
                self._end_cancelled()
                if not self._prefill_slice() and self._task_due():
                    self._run_task()
                self._decode()
            except Exception as exc:  # a bug here must not kill the model thread: fail what was running
                log.exception("scheduler step failed")
                for slot in list(self._slots):
                    slot.job.post(exc)
                    self._driver.finish(slot)

    def _admit(self) -> None:
        # under _cond
        while self._waiting and len(self._slots) < self.max_batch:
            job = self._waiting.popleft()
            if not job.claim():
                continue
            try:
                program = job.work(job.cancelled.is_set)
            except Exception as exc:
                job.post(exc)
                job.post(END)
                continue
            self._driver.add(_Request(program, job.post, job=job))

    def _runnable(self) -> bool:
        # under _cond
        return (bool(self._tasks) and self._task_due()) or \
            any(s.state != "offload" or s.cancelled() for s in self._slots)

    def _task_due(self) -> bool:
        return not self._slots or time.monotonic() >= self._next_task_at

    def _idle_wait(self) -> float:
        return max(0.001, min(1.0, self._next_task_at - time.monotonic())) if self._tasks else 1.0

    def _end_cancelled(self) -> None:
        for slot in [s for s in self._slots if s.cancelled()]:
            self._driver.finish(slot)

    def _prefill_slice(self) -> bool:
        """Advance the least served request that is neither decoding nor offloaded, for up to one slice.

        While streams are answering, a slice may last until they have waited `max_stall_s` for their next
        token (the step after it included), at least `slice_s`: the prefill joins their batch as early as
        that allows. A prefill crawling at a share of the thread instead would leave every step until it
        joins a row short, and the last stream to join decoding alone at the end."""
        slot = min((s for s in self._slots if s.state == "ready"), key=lambda s: s.served_s, default=None)
        if slot is None:
            return False
        streaming = any(s.state == "decode" for s in self._slots)
        budget = max(self.slice_s, self.max_stall_s - self._driver.last_step_s) if streaming else self.slice_s
        start = time.monotonic()
        with self._working(slot.label):
            while self._driver.advance(slot) and time.monotonic() < start + budget \
                    and not self._newcomer_ready(slot):
                pass
        slot.served_s += time.monotonic() - start
        return True

    def _newcomer_ready(self, slot: _Request) -> bool:
        """Whether a new request waits for a free slot (admitted, it starts its plan off this thread), or one that
        has had no slice yet is ready (its plan done): the slice ends at this piece of work (a layer's chunk), not
        at its budget, and the newcomer goes next. (Requests already served take turns a slice at a time.)"""
        if self._waiting and len(self._slots) < self.max_batch:  # read without the lock: a hint, checked in _admit
            return True
        return any(s is not slot and s.state == "ready" and s.served_s == 0.0 for s in self._slots)

    def _run_task(self) -> None:
        with self._cond:
            task = self._tasks.popleft() if self._tasks else None
        if task is None or not task.future.set_running_or_notify_cancel():
            return
        start = time.monotonic()
        with self._working(task.label):
            try:
                task.future.set_result(task.fn())
            except BaseException as exc:  # the caller gets it
                task.future.set_exception(exc)
        end = time.monotonic()
        self._next_task_at = end + (end - start) * (1 / TASK_SHARE - 1)

    def _decode(self) -> None:
        waiting = self._driver.waiting()
        rows = len(waiting)
        if not rows:
            return
        for slot in waiting:
            slot.answered = True
        with self._working(f"decode step ({rows} rows)"):
            self._driver.decode()
        self._decode_steps[rows] += 1
        self._decode_seconds[rows] += self._driver.last_step_s

    def _offload_call(self, slot: Slot, fn: Callable[[], Any]) -> None:
        def done(future: concurrent.futures.Future) -> None:
            with self._cond:
                if future.cancelled():
                    slot.error = WorkerStopped()
                elif future.exception() is not None:
                    slot.error = future.exception()
                else:
                    slot.value = future.result()
                slot.state = "ready"
                self._cond.notify()
        try:
            self._offload.submit(fn).add_done_callback(done)
        except RuntimeError:  # the executor is shut down: we are stopping
            slot.state, slot.error = "ready", WorkerStopped()

    def _finished(self, slot: _Request) -> None:
        """The driver ended `slot`'s program (its cleanup ran on this thread): its client's stream ends."""
        self._request_s = 0.8 * self._request_s + 0.2 * (time.monotonic() - slot.admitted)
        slot.job.post(END)

    @contextmanager
    def _working(self, label: str) -> Iterator[None]:
        """Mark what the model thread runs and since when (/health reads it to tell stuck from busy)."""
        self._current = (label, time.monotonic())
        try:
            yield
        finally:
            self._current = None
