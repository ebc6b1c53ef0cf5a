"""common/threads.py: torch's intra-op threads are the model thread's; every other thread runs its ops serially."""
from __future__ import annotations

import threading

import torch

from common import threads


def run_in_thread(target) -> int:
    seen = []
    thread = threading.Thread(target=lambda: (target(), seen.append(torch.get_num_threads())))
    thread.start()
    thread.join()
    return seen[0]


def test_a_helper_runs_serially_and_the_model_thread_keeps_its_own_count(monkeypatch):
    monkeypatch.setattr(threads, "MODEL_THREADS", 2)
    assert run_in_thread(threads.serial_torch) == 1
    assert run_in_thread(lambda: None) == 1           # a helper's count is what a new thread starts with...
    assert run_in_thread(threads.model_torch) == 2    # ...so the model thread sets its own
    assert run_in_thread(lambda: threads.serially(lambda: None)) == 1


def test_a_pool_thread_runs_serially_after_the_model_thread_started():
    threads.model_torch()  # as the scheduler's thread does (here the test's own, restored below)
    try:
        assert run_in_thread(lambda: threads.serially(torch.ones(4).sum)) == 1
    finally:
        torch.set_num_threads(threads.MODEL_THREADS)


def test_each_threads_count_holds_whatever_another_thread_sets_before_its_first_parallel_op(monkeypatch):
    """A thread's first parallel op sets its count from the process-wide one, the last any thread set: a model
    thread that set 2 ran serially once a helper had set 1 in between, and a helper that set 1 got a team of its own
    once a model thread had set 2. Each count is set past that first op, so it holds."""
    monkeypatch.setattr(threads, "MODEL_THREADS", 2)
    counts: dict[str, int] = {}
    model_set, helper_set, model_ran = threading.Event(), threading.Event(), threading.Event()

    def model() -> None:
        threads.model_torch()
        model_set.set()
        helper_set.wait(10)
        torch.ones(64).sum()
        counts["model"] = torch.get_num_threads()
        threads.model_torch()  # the process-wide count is 2 again before the helper's first op
        model_ran.set()

    def helper() -> None:
        model_set.wait(10)
        threads.serial_torch()
        helper_set.set()
        model_ran.wait(10)
        torch.ones(64).sum()
        counts["helper"] = torch.get_num_threads()

    workers = [threading.Thread(target=model), threading.Thread(target=helper)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(30)
    try:
        assert counts == {"model": 2, "helper": 1}
    finally:
        torch.set_num_threads(threads.MODEL_THREADS)
