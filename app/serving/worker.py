"""Jobs handed from the event loop to a thread, and a worker thread that runs them one at a time.

A Job is the asyncio side's handle on work done in another thread: the work's items (a query's
token ids and result, an ingest's result) reach the event loop through an asyncio.Queue fed with
`call_soon_threadsafe`; a query's output (the engine's QueryOutput) turns them into text there. The model thread
(app.serving.scheduler) runs query jobs several at a time; the
Worker here runs jobs one at a time in arrival order — the server's ingest lane (uploads and
deletes: chunking and embedding happen there, off the model thread), where a job that `yields` (a
slice of an embeddings call) waits behind every job that does not: an upload waits for the slice
that runs, not for every call's next one. Either way the queue of
waiting jobs is bounded (a full one is the caller's 429), and a job that waited past its deadline is
dropped unstarted (503).
"""
from __future__ import annotations

import asyncio
import math
import queue
import threading
import time
from itertools import count
from typing import Any, AsyncIterator, Callable, Iterable

from blend.driver import Output
from common.threads import serial_torch

Cancelled = Callable[[], bool]
Work = Callable[[Cancelled], Iterable[Any]]

STARTED, END = object(), object()  # the first and the last item of every job


class QueueFull(Exception):
    """No room in the waiting queue."""


class QueueTimeout(Exception):
    """The job waited longer than its timeout and was dropped unstarted."""


class WorkerStopped(Exception):
    """The server is shutting down."""


class Job:
    """One unit of work; iterate it (async) for the items its work yields, or, with an `output`
    (blend.driver.Output: a query's), for what the output makes of them, on the event loop."""

    def __init__(self, work: Callable[..., Any], loop: asyncio.AbstractEventLoop, label: str = "",
                 output: Output | None = None):
        self.work, self.loop, self.label, self.output = work, loop, label, output
        self.cancelled = threading.Event()  # set by the caller: the client went away
        self.stopped = threading.Event()  # set by its output: a stop string ended the answer
        self.submitted = time.monotonic()
        self.started: float | None = None
        self._events: asyncio.Queue[Any] = asyncio.Queue()
        self._state = "queued"  # -> "running" (worker) or "dropped" (caller timed out / cancelled)
        self._lock = threading.Lock()

    # -- worker thread side --
    def claim(self) -> bool:
        """Queued → running; False if the caller gave up on it meanwhile."""
        with self._lock:
            if self._state != "queued" or self.cancelled.is_set():
                self._state = "dropped"
                return False
            self._state, self.started = "running", time.monotonic()
        self.post(STARTED)
        return True

    def halt(self) -> str | None:
        """Why the model thread should end this job's request now: "cancelled", "stop" (its output), or None."""
        return "cancelled" if self.cancelled.is_set() else "stop" if self.stopped.is_set() else None

    @property
    def waiting(self) -> bool:
        """Still queued, and its caller still wants it."""
        return self._state == "queued" and not self.cancelled.is_set()

    def post(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self._events.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server stopped): nobody is listening
            pass

    # -- asyncio side --
    async def wait_started(self, timeout: float) -> None:
        """Return once the worker runs this job; QueueTimeout if it is still queued after `timeout`."""
        try:
            first = await asyncio.wait_for(self._events.get(), timeout)
        except asyncio.TimeoutError:
            if self._drop():
                raise QueueTimeout from None
            first = await self._events.get()  # it started just now
        assert first is STARTED

    def _drop(self) -> bool:
        with self._lock:
            if self._state == "queued":
                self._state = "dropped"
                return True
            return False

    def cancel(self) -> None:
        """Stop the work at its next check (or never start it)."""
        self.cancelled.set()

    @property
    def queue_s(self) -> float:
        return (self.started or time.monotonic()) - self.submitted

    async def __aiter__(self) -> AsyncIterator[Any]:
        while (item := await self._events.get()) is not END:
            if isinstance(item, BaseException):
                raise item
            if self.output is None:
                yield item
                continue
            events = self.output.feed(item)
            if self.output.stopped:  # the model thread ends the request at its next step
                self.stopped.set()
            for event in events:
                yield event

    async def result(self) -> Any:
        """The last item (for one-shot work such as an ingest)."""
        last = None
        async for last in self:
            pass
        return last


class Worker:
    def __init__(self, queue_size: int, name: str = "ragblend-worker"):
        # (0, order, job): the lane's own work, in arrival order; (1, ...): jobs that yield to it; (-1, ...): stop
        self._queue: queue.PriorityQueue[tuple[int, int, Job | None]] = queue.PriorityQueue(maxsize=queue_size)
        self._order = count()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._stopping = False
        self._current: Job | None = None
        self._job_s = 1.0  # moving average of a job's run time, for Retry-After

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    @property
    def running(self) -> int:
        return int(self._current is not None)

    def snapshot(self) -> dict[str, Any]:
        """The thread's state, for /health."""
        current = self._current
        return {"alive": self._thread.is_alive(), "waiting": self.waiting,
                "current": None if current is None or current.started is None else
                {"work": current.label, "age_s": round(time.monotonic() - current.started, 3)}}

    def retry_after(self) -> int:
        """Seconds until the queue has likely drained a place: an estimate for Retry-After."""
        return min(60, max(1, math.ceil(self._job_s * (self.waiting + 1))))

    def cancelled(self) -> bool:
        """Whether the running job's caller has given up (for work that checks from deeper down)."""
        current = self._current
        return current is not None and current.cancelled.is_set()

    def start(self) -> None:
        self._thread.start()

    def submit(self, work: Work, label: str = "", yields: bool = False) -> Job:
        """Queue `work` (call from the event loop), behind every job that does not yield if it `yields`;
        QueueFull / WorkerStopped if it cannot wait."""
        if self._stopping:
            raise WorkerStopped
        job = Job(work, asyncio.get_running_loop(), label)
        try:
            self._queue.put_nowait((int(yields), next(self._order), job))
        except queue.Full:
            raise QueueFull from None
        return job

    def begin_stop(self) -> None:
        """Refuse new jobs, fail the waiting ones and cancel the running one (it stops at its next check)."""
        self._stopping = True
        if (current := self._current) is not None:
            current.cancel()
        while True:
            try:
                _, _, job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None and job.claim():
                job.post(WorkerStopped())
                job.post(END)

    def stop(self, timeout: float = 10.0) -> bool:
        """`begin_stop`, then end the thread; True if it has ended."""
        self.begin_stop()
        if self._thread.is_alive():
            try:
                self._queue.put((-1, next(self._order), None), timeout=timeout)
            except queue.Full:
                pass
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        serial_torch()  # serially: the model thread's workers keep spinning (common.threads)
        while (job := self._queue.get()[2]) is not None:
            if job.claim():
                self._execute(job)

    def _execute(self, job: Job) -> None:
        self._current, items = job, None
        start = time.monotonic()
        try:
            items = job.work(job.cancelled.is_set)
            for item in items:
                job.post(item)
                if job.cancelled.is_set():
                    break
        except Exception as exc:  # the caller turns it into an error response
            job.post(exc)
        finally:
            getattr(items, "close", lambda: None)()  # end a generator now, not at garbage collection
            self._current = None
            self._job_s = 0.8 * self._job_s + 0.2 * (time.monotonic() - start)
            job.post(END)
