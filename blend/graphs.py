"""CUDA graphs for the decode step: captured once per shape, replayed with new inputs copied in.

`StepGraphs.run(key, step, inputs)` runs `step(**inputs)` (inputs: tensors only; whatever else shapes
the step is in `key`). Enabled, the first call for a key copies the inputs into static buffers,
captures the step over them (`capture`, by default a torch.cuda.CUDAGraph after a warm-up on a side
stream; it returns the static output, filled by each replay) and replays it; later calls copy the new
inputs into the same buffers and replay. The output is the graph's static tensor (or tuple of them): read
it (e.g. `.tolist()`) before the next run. A capture that fails (an op that syncs with the host, a kernel
graphs cannot hold) turns graphs off for good, with the reason logged and kept in `disabled`; that
call and every later one run eagerly.

The capture is a parameter so the logic (static buffers, one capture per key, the fallback) runs on
the CPU in tests; on the CPU the backend (Backend.step_graphs) passes enabled=False and the step runs eagerly.
Capturing runs the step for real (warm-up and capture), with this call's inputs: a step that writes
its K/V at the inputs' positions writes the same values the replay then writes again.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch

log = logging.getLogger("ragblend.blend")

Capture = Callable[[Callable[[], torch.Tensor]], tuple[torch.Tensor, Callable[[], None]]]


_memory_pool = None  # one memory pool shared by every captured step (their buffers never live at once)


def cuda_graph_capture(fn: Callable[[], torch.Tensor], warmup: int = 2) -> tuple[torch.Tensor, Callable[[], None]]:
    """Capture `fn` (which reads only static tensors) as a CUDA graph: (its static output, replay).
    The output holds nothing until the first replay."""
    global _memory_pool
    if _memory_pool is None:
        _memory_pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the default stream, as torch.cuda.graphs asks
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # thread_local: the server's other threads (KV loaders, the embedder) may call CUDA during a capture
    with torch.cuda.graph(graph, pool=_memory_pool, capture_error_mode="thread_local"):
        out = fn()
    return out, graph.replay


class StepGraphs:
    def __init__(self, enabled: bool, capture: Capture = cuda_graph_capture):
        self.enabled, self.capture = enabled, capture
        self.disabled: str | None = None if enabled else "off"   # why the step runs eagerly
        self._graphs: dict[Any, tuple[dict[str, torch.Tensor], Any, Callable[[], None]]] = {}

    @property
    def captured(self) -> list[Any]:
        return list(self._graphs)

    def run(self, key: Any, step: Callable[..., Any], inputs: dict[str, torch.Tensor]) -> Any:
        if not self.enabled:
            return step(**inputs)
        graph = self._graphs.get(key)
        if graph is None:
            static = {name: tensor.clone() for name, tensor in inputs.items()}
            try:
                out, replay = self.capture(lambda: step(**static))
            except Exception as exc:  # noqa: BLE001 - any failure means: no graphs, run eagerly
                self.enabled, self.disabled = False, f"CUDA graph capture failed: {type(exc).__name__}: {exc}"
                self._graphs.clear()
                log.warning("decode step runs eagerly", extra={"reason": self.disabled})
                return step(**inputs)
            self._graphs[key] = (static, out, replay)
        else:
            static, out, replay = graph
            for name, tensor in inputs.items():
                static[name].copy_(tensor)
        replay()
        return out
