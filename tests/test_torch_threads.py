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
