"""A process's periodic work in one place: the store's lease sweep, the app's KV usage flush, whatever else runs on
a timer. Each owner registers its task and cancels it when it closes; a task's error is logged and the rest go on.
A task that runs long only delays the others (they are all bookkeeping).

Who runs the tasks: its own thread (`ragblend-housekeeping`, started with the first task: the CLI, tests, any
process without an event loop), or, built with `thread=False`, whoever calls `run_due()` (the server's event loop
calls it on a bounded pool: app/serving/service.py), so a serving process has no thread for it."""
from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("ragblend.housekeeping")
THREAD_NAME = "ragblend-housekeeping"


class Task:
    """A registered periodic task; `cancel()` ends it (a run already under way finishes)."""

    def __init__(self, name: str, period_s: float, run: Callable[[], object]) -> None:
        self.name, self.period_s, self.run = name, period_s, run
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Housekeeping:
    """Runs each task every `period_s` (on its own thread, or `run_due`'s caller's); `close()` stops it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, thread: bool = True) -> None:
        self._clock, self._own_thread = clock, thread
        self._due: list[tuple[float, int, Task]] = []  # a heap: (when, order, task); a task running is not in it
        self._registered: list[Task] = []
        self._order = itertools.count()
        self._wake = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    def every(self, period_s: float, run: Callable[[], object], name: str) -> Task:
        """Run `run()` every `period_s` seconds (the first time one period from now) until cancelled or closed."""
        if not period_s > 0:
            raise ValueError(f"a period must be > 0, got {period_s}")
        task = Task(name, period_s, run)
        with self._wake:
            if self._closed:
                raise RuntimeError("housekeeping is closed")
            heapq.heappush(self._due, (self._clock() + period_s, next(self._order), task))
            self._registered.append(task)
            if self._thread is None and self._own_thread:
                self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
                self._thread.start()
            self._wake.notify()
        return task

    def tasks(self) -> list[str]:
        """The names of the tasks registered and not cancelled (one running now too)."""
        with self._wake:
            self._registered = [task for task in self._registered if not task.cancelled]
            return [task.name for task in self._registered]

    def run_due(self) -> float | None:
        """Run every task due now on the caller's thread; the seconds until the next one is due (None: no task)."""
        while True:
            with self._wake:
                while self._due and self._due[0][2].cancelled:
                    heapq.heappop(self._due)
                if self._closed or not self._due:
                    return None
                if (wait := self._due[0][0] - self._clock()) > 0:
                    return wait
                task = heapq.heappop(self._due)[2]
            self._run_one(task)

    def _run(self) -> None:
        while (task := self._next()) is not None:
            self._run_one(task)

    def _run_one(self, task: Task) -> None:
        try:
            task.run()
        except Exception:
            log.exception("housekeeping: %s failed", task.name)
        with self._wake:
            if not task.cancelled:
                heapq.heappush(self._due, (self._clock() + task.period_s, next(self._order), task))

    def _next(self) -> Task | None:
        """The next task once it is due; None once closed."""
        with self._wake:
            while not self._closed:
                while self._due and self._due[0][2].cancelled:
                    heapq.heappop(self._due)
                if self._due and self._due[0][0] <= self._clock():
                    return heapq.heappop(self._due)[2]
                self._wake.wait(None if not self._due else self._due[0][0] - self._clock())
            return None

    def close(self) -> None:
        """Stop the thread (a task under way finishes first). Idempotent."""
        with self._wake:
            self._closed = True
            self._wake.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
