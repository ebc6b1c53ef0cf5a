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
