"""The scheduler: one thread owns the model and runs every request's work on it, a step at a time.

Requests are data (blend.driver.Request: phase, prefill work served, decoding sequence); each round the model
thread admits queued requests into free slots, builds a step from their states (blend.driver.schedule: which
requests end, which decode rows run, which prefill slices, within `server.step_token_budget` tokens) and runs it
(blend.driver.Runner): the step's sampled ids go to each request's job once per step, and everything after them
(detokenising, stop strings, tool calls, events) happens on the event loop (Job's output: the engine's
QueryOutput). This module adds what a server needs around it: the model thread, the queue and admission, the
offload pool (`ragblend-prep`) that runs each request's `prepare` (retrieval, store reads), model tasks (other
threads hand the model thread whole functions with `run_on_model`: an upload's chunk precompute), /health and
Retry-After.

Each request holds a slot from admission to its last token; at most `max_batch` slots, the decode KV pool's
slots (blend.pool: the server sizes both from server.max_batch; a request takes its pool slot when its prefill
ends and gives it back when it ends, cancelled or done). A round:
    1. admit queued requests into free slots (their `prepare` starts on the offload pool); note which ones their
       client left (cancelled) or their output side stopped (a stop string)
    2. the step: blend.driver.schedule, a pure function of the requests' states (least attained service, so a
       newcomer's first slice runs in the next step and a short request first; every decode row each step)
    3. a model task before the step when `task_due`, a rule over state: always when no request uses the model
       thread, else once the requests' work since the last task is (1 / TASK_SHARE - 1) times that task's cost
       (a chunk's precompute: a query waits about one chunk behind an upload, and its tokens keep flowing)
    4. run the step
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
from itertools import count
from typing import Any, Callable, Iterator

from app.serving.worker import END, Job, QueueFull, WorkerStopped
from blend.driver import Advance, Output, Request, Runner, Step, Work, schedule
from common.threads import model_torch, serial_torch

__all__ = ["Scheduler", "task_due"]
log = logging.getLogger("ragblend.scheduler")

Cancelled = Callable[[], bool]
TASK_SHARE = 0.25  # while requests are in flight, model tasks (upload chunks) get at most this share of the thread


@dataclass(eq=False)
class _Request(Request):
    """A request's state, with the job that carries its token ids and result to its client."""
    job: Job | None = None
    admitted: float = field(default_factory=time.monotonic)

    @property
    def label(self) -> str:
        return f"request {self.job.label}"


@dataclass(eq=False)
class _Task:
    fn: Callable[[], Any]
    label: str
    cost: int  # tokens it runs through every layer (a chunk's precompute: the chunk's tokens)
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


def task_due(in_flight: bool, work_since: int, last_cost: int, share: float = TASK_SHARE) -> bool:
    """Whether a waiting model task runs before this step: always when no request uses the model thread, else
    once the requests' work since the last task (token-layers) has reached (1 / share - 1) times its cost."""
    return not in_flight or work_since * share >= last_cost * (1 - share)


class Scheduler:
    def __init__(self, advance: Advance, *, layers: int, max_batch: int, queue_size: int,
                 step_token_budget: int = 64, offload_threads: int = 1):
        self.max_batch, self.queue_size, self.layers, self.budget = max_batch, queue_size, layers, step_token_budget
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()   # guarded by _cond
        self._tasks: deque[_Task] = deque()   # guarded by _cond
        self._requests: dict[int, _Request] = {}  # in flight, by id: the model thread's own
        self._ids = count()
        self._runner = Runner(advance, on_end=self._finished)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="ragblend-model", daemon=True)
        self._offload = concurrent.futures.ThreadPoolExecutor(offload_threads, thread_name_prefix="ragblend-prep",
                                                              initializer=serial_torch)
        self._current: tuple[str, float] | None = None  # (what the model thread runs, since when)
        self._decode_steps: Counter[int] = Counter()  # batched steps by their number of rows (step_totals)
        self._decode_seconds: Counter[int] = Counter()  # ... and the seconds they took
        self._request_s = 1.0  # moving average of a request's time in its slot, for Retry-After
        self._work_since_task = 0  # token-layers of request work since the last model task (task_due)
        self._last_task_cost = 0

    # ---- any thread ------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def waiting(self) -> int:
        with self._cond:
            return sum(1 for job in self._waiting if job.waiting)

    @property
    def _slots(self) -> list[_Request]:
        return list(self._requests.copy().values())  # (a copy: other threads read it while the model thread runs)

    @property
    def active(self) -> int:
        return len(self._requests)

    def retry_after(self) -> int:
        """Seconds until a slot is likely free for one more waiting request: an estimate for Retry-After."""
        return min(60, max(1, math.ceil(self._request_s * (self.waiting + 1) / self.max_batch)))

    def submit(self, work: Callable[[], Work], label: str = "", output: Output | None = None) -> Job:
        """Queue a request (call from the event loop): `work()` makes its model work when it is admitted; `output`
        turns its token ids into what its client sees (on the event loop, as the job is iterated). QueueFull /
        WorkerStopped if it cannot wait."""
        job = Job(work, asyncio.get_running_loop(), label, output)
        with self._cond:
            if self._stopping:
                raise WorkerStopped
            self._waiting = deque(j for j in self._waiting if j.waiting)  # forget dropped ones
            if len(self._waiting) >= self.queue_size:
                raise QueueFull
            self._waiting.append(job)
            self._cond.notify()
        return job

    def run_on_model(self, fn: Callable[[], Any], *, label: str, cost: int = 0,
                     cancelled: Cancelled | None = None) -> Any:
        """Run `fn()` on the model thread between steps and return its result (blocking; never call it from the
        model thread). `cost`: the tokens it runs through every layer (task_due weighs it). CancelledError
        (concurrent.futures) if `cancelled()` turns true before it started; WorkerStopped if the scheduler stops
        first."""
        task = self._add_task(fn, label, cost)
        while True:
            try:
                return task.future.result(timeout=0.1)
            except concurrent.futures.TimeoutError:
                if cancelled is not None and cancelled():
                    task.future.cancel()  # a no-op once it runs: then it finishes (one chunk) and we return

    def _add_task(self, fn: Callable[[], Any], label: str, cost: int) -> _Task:
        task = _Task(fn, label, cost)
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
        since += [r.job.submitted for r in self._slots if r.phase in ("prepare", "prefill")]
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
            "decoding": sum(1 for r in slots if r.phase == "decode"),
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
                if self._stopping and not self._requests and not self._tasks:
                    return
                for request in self._requests.values():
                    request.halt = request.halt or request.job.halt()
                step = schedule(self._requests.values(), self.budget, self.layers)
                in_flight = any(r.phase in ("prefill", "decode") for r in self._requests.values())
                task = bool(self._tasks) and task_due(in_flight, self._work_since_task, self._last_task_cost)
                if not step and not task:
                    self._cond.wait(1.0)
                    continue
            try:
                model_torch()  # torch's intra-op threads are this thread's, each time (common.threads)
                if task:
                    self._run_task()
                if step:
                    self._step(step)
            except Exception as exc:  # a bug here must not kill the model thread: fail what was running
                log.exception("scheduler step failed")
                for request in self._slots:
                    request.emit(exc)
                    self._runner.close(request)

    def _admit(self) -> None:
        # under _cond
        while self._waiting and len(self._requests) < self.max_batch:
            job = self._waiting.popleft()
            if not job.claim():
                continue
            try:
                work = job.work()
            except Exception as exc:
                job.post(exc)
                job.post(END)
                continue
            request = _Request(work, job.post, next(self._ids), job=job)
            self._requests[request.id] = request
            self._prepare(request)

    def _prepare(self, request: _Request) -> None:
        """The request's `prepare` on the offload pool; then its prefill is ready for a step."""
        def done(future: concurrent.futures.Future) -> None:
            with self._cond:
                if request.phase == "prepare":  # (not ended meanwhile)
                    error = WorkerStopped() if future.cancelled() else future.exception()
                    if error is not None:
                        request.emit(error)
                        request.halt = "cancelled"  # ended by the next step; its error is out
                    request.phase = "prefill"
                self._cond.notify()
        try:
            self._offload.submit(request.work.prepare).add_done_callback(done)
        except RuntimeError:  # the executor is shut down: we are stopping
            request.emit(WorkerStopped())
            request.halt = "cancelled"

    def _step(self, step: Step) -> None:
        before = self._runner.prefilled
        with self._working(self._describe(step)):
            self._runner.run(step, self._requests)
        rows, seconds = self._runner.last_decode if step.decode else (0, 0.0)
        if rows:
            self._decode_steps[rows] += 1
            self._decode_seconds[rows] += seconds
        self._work_since_task += self._runner.prefilled - before + rows * self.layers

    def _describe(self, step: Step) -> str:
        """What the step runs, for /health: the request whose prefill it advances, else its decode rows (never a
        client's text: a request's label is its kind)."""
        if step.prefill:
            return self._requests[step.prefill[0].request].label
        return f"decode step ({len(step.decode)} rows)" if step.decode else "ending requests"

    def _run_task(self) -> None:
        with self._cond:
            task = self._tasks.popleft() if self._tasks else None
        if task is None or not task.future.set_running_or_notify_cancel():
            return
        with self._working(task.label):
            try:
                task.future.set_result(task.fn())
            except BaseException as exc:  # the caller gets it
                task.future.set_exception(exc)
        self._work_since_task, self._last_task_cost = 0, task.cost * self.layers

    def _finished(self, request: _Request) -> None:
        """The runner ended `request` (on this thread): its slot is free, its client's stream ends."""
        self._requests.pop(request.id, None)
        self._request_s = 0.8 * self._request_s + 0.2 * (time.monotonic() - request.admitted)
        request.job.post(END)

    @contextmanager
    def _working(self, label: str) -> Iterator[None]:
        """Mark what the model thread runs and since when (/health reads it to tell stuck from busy)."""
        self._current = (label, time.monotonic())
        try:
            yield
        finally:
            self._current = None
