"""common.housekeeping: one thread runs every periodic task; a failing task does not stop the others."""
from __future__ import annotations

import threading

from common.housekeeping import THREAD_NAME, Housekeeping


def test_one_thread_runs_every_task_until_cancelled_or_closed():
    keeping = Housekeeping()
    ran: dict[str, list[str]] = {"a": [], "b": [], "bad": []}
    enough = threading.Event()

    def task(name: str):
        def run() -> None:
            ran[name].append(threading.current_thread().name)
            if name == "bad":
                raise RuntimeError("a failing task")
            if len(ran["a"]) >= 3 and len(ran["b"]) >= 3:
                enough.set()
        return run
    tasks = {name: keeping.every(0.01, task(name), name) for name in ran}
    assert enough.wait(10)
    assert {name for runs in ran.values() for name in runs} == {THREAD_NAME}  # one thread for all
    assert len(ran["bad"]) >= 2  # it failed and ran again
    tasks["a"].cancel()
    assert sorted(keeping.tasks()) == ["b", "bad"]
    keeping.close()
    assert not keeping._thread.is_alive()


def test_without_a_thread_the_caller_runs_what_is_due():
    now = [0.0]
    keeping = Housekeeping(clock=lambda: now[0], thread=False)
    ran: list[str] = []
    keeping.every(1.0, lambda: ran.append("sweep"), "sweep")
    keeping.every(2.5, lambda: ran.append("flush"), "flush")
    assert keeping.run_due() == 1.0 and ran == []  # nothing due yet: the wait until the first is
    now[0] = 2.6
    assert keeping.run_due() == 1.0 and sorted(ran) == ["flush", "sweep"]  # both ran, next sweep one period on
    assert keeping._thread is None  # no thread was started
    keeping.close()
    assert keeping.run_due() is None
