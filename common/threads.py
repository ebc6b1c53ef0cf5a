"""Torch's intra-op threads are the model thread's alone.

libgomp lets a team's workers spin between parallel regions only while it manages no more threads than the machine
has CPUs. Once another thread runs a parallel torch op it keeps a team of its own, and from then on every team's
workers sleep between regions: each of a decode step's ~150 regions pays a wake-up (SmolLM2, 3.1k tokens, two
cores: 35 ms a step alone, 62 ms while another thread kept a team). So every other thread that runs torch ops (the
store's writer and readers, the KV loader, the lanes, the blocking pools) runs them on itself alone, `serial_torch()`
first; the model thread (and the loader that builds the model) keeps the count the process started with.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

MODEL_THREADS = torch.get_num_threads()  # at import, on the importing (main) thread: OMP_NUM_THREADS or the cores
_local = threading.local()
T = TypeVar("T")


def _set_threads(count: int) -> None:
    """This thread's torch ops on `count` threads. A thread's first parallel op (in torch, and again in each library
    built on its headers: blend's CPU kernels) sets its count from the process-wide one, the last any thread set;
    torch.get_num_threads() is torch's first here, so the count set after it stays."""
    torch.get_num_threads()
    torch.set_num_threads(count)


def serial_torch() -> None:
    """This thread's torch ops run on it alone, with no OpenMP team of its own (cheap after the first call)."""
    if not getattr(_local, "serial", False):
        _set_threads(1)
        _local.serial = True


def model_torch() -> None:
    """This thread runs the model: torch's ops on MODEL_THREADS threads. The model thread calls it before each step
    (~0.5 µs), as the CPU kernels' first call on it may have set its count from another thread's 1 (a decode step
    1.8x slower, a prefill 2.4x, in the server, when the model thread's count was set once)."""
    _set_threads(MODEL_THREADS)
    _local.serial = False


def serially(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` on this (pool) thread, its torch ops serial."""
    serial_torch()
    return fn(*args, **kwargs)
