"""Layer-wise KV loading for the blended prefill: each chunk's K/V reaches the cache a layer at a time.

A LayerSource is one chunk's cached K/V read layer by layer: a store entry opened for per-layer
reads (store.LayeredEntry fits the protocol as it is) or an in-memory ChunkKV (KVLayers: the prompt
head, a fresh precompute after a miss). The LayerLoader writes layer i of every chunk into the
prompt cache's buffer, keys RoPE-shifted to the chunk's place, in the model's dtype and on its device.

Pipelined, where the backend's stager says loading overlaps the compute (on a GPU, always: the copies
run on a side stream; on the host, only where a source waits on I/O: a byte tier's read), the loader
runs on its own thread and stays at most `ahead` layers in front of the prefill: while layer i
computes, layer i+1 is read, checked, decoded and shifted (all of which release the GIL). The
prefill calls `wait(i)` before layer i reads its cached K/V (BlendCache.before_read), so it never
sees a layer that is not there yet. Not pipelined, every layer is loaded before the prefill starts:
the same copies in the same order, so the same logits.

A layer that cannot be read (damaged, gone) makes its chunk a miss: `wait` raises ChunkMiss and
the prefill recomputes that chunk and starts again (Blender.prefill_steps `recompute`).
On CUDA (blend.backend's stager) the copies run on a side stream (pinned host layers, non-blocking
copies) and `wait` makes the compute stream wait for that layer's event instead of the host.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Protocol, Sequence

import torch

from common.chunk_kv import ChunkKV
from common.threads import serially

log = logging.getLogger("ragblend.blend")
HELD_GROUP_BYTES = 32 << 20  # the keys of this many bytes of layers are gathered at once (_load_held)


class LayerSource(Protocol):
    """One chunk's K/V, layer by layer: the contract between the blend loop and the store.

    `layer(i, device, dtype)` -> (keys [H, T, D], values [H, T, D]) of layer i, keys rotated for
    positions `position ..` (the loader shifts them), on `device` in `dtype` — the source does the
    host -> device copy and any dequantisation (int8 + scales are dequantised on the device, after
    the copy). On CUDA the copy may be queued asynchronously on the current stream (the loader's side
    stream, whose event the prefill waits on), so host tensors handed over must stay alive and
    unchanged (pinned memory that the source owns). A source that already holds the layer on
    `device` in `dtype` returns it without a copy; the caller never writes into what it gets.
    With device/dtype None the layer comes back as stored, on the host (tests, tools).
    `layer` may raise (a store's LayerReadError): the chunk is then a miss, recomputed.
    A `resident` source also gives every layer at once, `held(device, dtype)` -> (keys, values [L, H, T, D]),
    so a loader that runs before the prefill copies a group of layers of every chunk in one operation.
    """

    token_ids: torch.Tensor   # [T] int64
    position: int
    context_hash: str
    fingerprint: str
    shape: tuple[int, int, int, int]   # [L, H, T, D]
    resident: bool   # its layers are tensors held in memory: a read is a copy, it waits on no I/O

    def layer(self, i: int, device: torch.device | None = None, dtype: torch.dtype | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]: ...
    def held(self, device: torch.device | None = None, dtype: torch.dtype | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]: ...
    def close(self) -> None: ...


class KVLayers:
    """An in-memory ChunkKV as a LayerSource."""

    resident = True

    def __init__(self, kv: ChunkKV):
        self.kv = kv
        self.token_ids, self.position = kv.token_ids, kv.position
        self.context_hash, self.fingerprint = kv.context_hash, kv.fingerprint
        self.shape = tuple(kv.keys.shape)

    def layer(self, i: int, device: torch.device | None = None, dtype: torch.dtype | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.kv.keys[i], self.kv.values[i]                                  # [H, T, D] each
        return k.to(device, dtype, non_blocking=True), v.to(device, dtype, non_blocking=True)

    def held(self, device: torch.device | None = None, dtype: torch.dtype | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv.keys.to(device, dtype), self.kv.values.to(device, dtype)                 # [L, H, T, D]

    def close(self) -> None:
        pass


class Fresh:
    """Tokens with no KV, laid out between cached segments: the prefill computes them through every layer
    (forced into the recompute set), so a span the store lacks needs no compute before the prefill. Its
    layers read as zeros until the prefill writes them."""

    context_hash = ""  # never an exact prefix
    resident = True  # nothing to read

    def __init__(self, token_ids: torch.Tensor, position: int, kv_heads: int, head_dim: int, num_layers: int):
        self.token_ids, self.position, self.fingerprint = token_ids, position, ""
        self.shape = (num_layers, kv_heads, len(token_ids), head_dim)

    def layer(self, i: int, device: torch.device | None = None, dtype: torch.dtype | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        zeros = torch.zeros(self.shape[1:], device=device, dtype=dtype)                   # [H, T, D]
        return zeros, zeros

    def held(self, device: torch.device | None = None, dtype: torch.dtype | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        zeros = torch.zeros((), device=device, dtype=dtype).expand(self.shape)          # [L, H, T, D], no memory
        return zeros, zeros

    def close(self) -> None:
        pass


def as_source(segment: ChunkKV | LayerSource) -> LayerSource:
    return KVLayers(segment) if isinstance(segment, ChunkKV) else segment


class ChunkMiss(RuntimeError):
    """Chunk `index` could not be loaded (`cause` says why): recompute it, never use its KV."""

    def __init__(self, index: int, cause: BaseException):
        super().__init__(f"chunk {index} could not be loaded: {cause}")
        self.index, self.cause = index, cause


class LayerLoader:
    """Fills the slots `bounds[j]` of `keys`/`values` [L, H, N, D] with chunk j's layers, layer by layer.

    The chunks lie back to back from position 0 (bounds[0] starts at 0). Per layer: each source's layer
    is fetched, then every chunk is placed and RoPE-shifted by one batched operation (`rope.place` with
    per-token cos/sin computed once here: RopeShifter), with no host synchronisation. `stager`
    (blend.backend) says where the copies are queued and how the prefill waits for a layer. Each layer loaded is
    logged at debug level ("kv layer loaded": its layer, start_s and end_s on time.perf_counter's clock).
    """

    def __init__(self, sources: Sequence[LayerSource], bounds: Sequence[tuple[int, int]], keys: torch.Tensor,
                 values: torch.Tensor, rope, stager, *, pipelined: bool, ahead: int = 2):
        self.sources, self.bounds, self.keys, self.values, self.rope = sources, bounds, keys, values, rope
        self.num_layers, self.ahead, self.stager = keys.shape[0], max(1, ahead), stager
        self.cached = bounds[-1][1] if bounds else 0
        if any(lo != prev for (lo, _), prev in zip(bounds, [0] + [hi for _, hi in bounds])):
            raise ValueError("chunk slots must lie back to back from position 0")
        # Per token of the cached prefix: how far its chunk moved; the rotation for that, once per prompt.
        lengths = torch.tensor([hi - lo for lo, hi in bounds], dtype=torch.int64)
        moves = torch.tensor([lo - s.position for s, (lo, _) in zip(sources, bounds)], dtype=torch.int64)
        cos, sin = rope.rotation(moves.repeat_interleave(lengths), keys.dtype)                    # [N, D/2] or [N, D]
        self.cos, self.sin = cos.to(keys.device), sin.to(keys.device)
        self._gathered: torch.Tensor | None = None   # [(G,) H, N, D] the chunks' keys, side by side
        self.wait_s = 0.0           # time the prefill spent waiting for layers
        self._cond = threading.Condition()
        self._loaded = 0            # layers 0.._loaded-1 are in the cache
        self._wanted = -1           # the highest layer the prefill has asked for
        self._error: BaseException | None = None
        self._stop = False
        self._thread: threading.Thread | None = None
        self.pipelined = bool(pipelined and sources and stager.overlaps(sources))  # a loader thread beside it
        if self.pipelined:
            self._thread = threading.Thread(target=serially, args=(self._run,), name="ragblend-kv-loader", daemon=True)
            self._thread.start()
        else:
            self._run()

    # ---- the prefill's side ----

    def wait(self, i: int) -> None:
        """Return once layer i of every chunk is in the cache; ChunkMiss if a chunk failed (at any layer)."""
        start = time.perf_counter()
        with self._cond:
            if i > self._wanted:
                self._wanted = i
                self._cond.notify_all()
            self._cond.wait_for(lambda: self._loaded > min(i, self.num_layers - 1) or self._error is not None)
            error = self._error
        self.wait_s += time.perf_counter() - start
        if error is not None:
            raise error
        # CUDA: the compute stream waits for the copies, the host does not
        self.stager.wait(min(i, self.num_layers - 1))

    def close(self) -> None:
        """Stop loading (the prefill is done or was abandoned) and wait for the thread."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    # ---- the loader's side ----

    def _run(self) -> None:
        with torch.inference_mode(), self.stager.scope():
            if self._thread is None and self.sources and all(source.resident for source in self.sources):
                return self._load_held()
            for i in range(self.num_layers):
                with self._cond:  # bounded read-ahead: at most `ahead` layers past what the prefill asked for
                    self._cond.wait_for(lambda: self._stop or i <= self._wanted + self.ahead
                                        or self._thread is None)
                    if self._stop:
                        return
                try:
                    self._load(i)
                except BaseException as exc:  # noqa: BLE001 - handed to the prefill, which decides
                    with self._cond:
                        self._error = exc
                        self._cond.notify_all()
                    return
                with self._cond:
                    self._loaded = i + 1
                    self._cond.notify_all()

    def _load_held(self) -> None:
        """Every layer of chunks held in memory, before the prefill: a group of layers of all of them in one copy
        and one rotation (a copy a chunk and layer cost more in calls than in bytes: ~100 chunks x 30 layers)."""
        held = []
        for j, source in enumerate(self.sources):
            try:
                held.append(source.held(self.keys.device, self.keys.dtype))                 # [L, H, T, D] each
            except Exception as exc:  # noqa: BLE001 - the prefill's to decide, as a failed layer's
                self._error = ChunkMiss(j, exc)
                return
        n, (_, heads, _, dim) = self.cached, self.keys.shape
        group = max(1, HELD_GROUP_BYTES // (heads * n * dim * self.keys.element_size()))
        for lo in range(0, self.num_layers, group):
            layers = slice(lo, min(lo + group, self.num_layers))
            self._place(layers, [k[layers] for k, _ in held], [v[layers] for _, v in held])  # [G, H, T, D] each
            for i in range(layers.start, layers.stop):
                self.stager.mark(i)
        self._loaded = self.num_layers

    def _place(self, layers: int | slice, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """The chunks' keys and values ([H, T, D] each, or [G, H, T, D] for a slice of layers) side by side into the
        cache's `layers`, keys rotated to 0..N-1."""
        n = self.cached
        if len(keys) == 1:
            gathered = keys[0]
        else:  # one buffer per prompt, refilled each time (in stream order on CUDA)
            shape = (*keys[0].shape[:-2], n, keys[0].shape[-1])                         # [(G,) H, N, D]
            if self._gathered is None or self._gathered.shape != shape:
                self._gathered = self.keys.new_empty(shape)
            gathered = torch.cat(keys, dim=-2, out=self._gathered)
        self.rope.place(self.keys[layers, :, :n], gathered, self.cos, self.sin)
        torch.cat(values, dim=-2, out=self.values[layers, :, :n])

    def _load(self, i: int) -> None:
        start = time.perf_counter()
        dtype, device = self.keys.dtype, self.keys.device
        keys, values = [], []
        for j, source in enumerate(self.sources):
            try:
                k, v = source.layer(i, device, dtype)                            # [H, T, D] each
            except Exception as exc:
                raise ChunkMiss(j, exc) from exc
            keys.append(k)
            values.append(v)
        if keys:
            self._place(i, keys, values)
        self.stager.mark(i)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("kv layer loaded", extra={"layer": i, "start_s": start, "end_s": time.perf_counter()})
