"""One stored chunk, read a layer at a time: what a pipelined prefill loads while it computes.

`TieredStore.open(key)` returns a LayerSource (blend.pipeline's contract, `layer(i, device, dtype)`):

- from a byte tier (disk, Redis) a `LayeredEntry`: the head (header, token ids) was read and
  checked at open; `layer(i)` reads layer i into a staging buffer (pinned where the model is on
  CUDA), checks its xxh3 digest and unpacks it on the model's device. With a read pool it reads
  ahead: opening queues layers 0..ahead-1 and each `layer(i)` queues layer i+ahead, so while the
  loader takes layer i of every chunk in turn, every chunk's next layers are already being read
  concurrently (file reads and copies release the GIL): a layer's load is bounded by the tier's
  bandwidth, not one thread, and the loader needs no change.
- from a tensor tier (memory, gpu) a `ResidentEntry`: layer i is the tensor the tier holds,
  handed over without a copy when it is already on the device in the dtype.

A layer that fails its checksum raises `LayerReadError` and the entry is dropped from that tier
(counted as corrupt): the caller recomputes the chunk, it never gets wrong KV.

Promotion: an entry whose every layer was read and checked is offered to the faster tiers when it
is closed (what was read is kept for that, so it costs no second read); one closed earlier is not.
The store hands each entry an `EntryHooks` (drop, count, promote): this module knows no store.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Executor, Future
from typing import Protocol

import torch

from common.chunk_kv import ChunkKV
from store.serialize import CorruptEntryError, EntryHead

log = logging.getLogger("ragblend.store")


class RangeReader(Protocol):
    """Byte ranges of one stored entry, as a tier's `reader(key)` opens it. Thread-safe.
    Optionally `read_into(offset, buffer) -> int` (bytes read) fills a writable buffer in place."""

    def read(self, offset: int, length: int) -> bytes | memoryview: ...  # fewer bytes past the end
    def close(self) -> None: ...


class EntryHooks(Protocol):
    """What an open entry tells the store it came from."""

    wants_bytes: bool  # a faster byte tier would take the entry's bytes on promotion
    wants_tensors: bool  # a faster tensor tier would take its layers on promotion

    def dropped(self, exc: Exception) -> None: ...  # the entry is damaged: delete it from its tier, count it
    def layer_read(self, nbytes: int, seconds: float) -> None: ...
    def promote(self, kv: ChunkKV | None, data: bytes | None) -> None: ...  # every layer was read


class LayerReadError(RuntimeError):
    """A layer could not be read: treat the chunk as a miss. `corrupt`: its bytes were damaged
    (the store has dropped the entry); otherwise the entry went away (deleted, expired, Redis
    unreachable) while it was being read."""

    def __init__(self, message: str, corrupt: bool) -> None:
        super().__init__(message)
        self.corrupt = corrupt


class _EntryInfo:
    """The attributes every opened entry shares (blend.pipeline.LayerSource's, and a few more)."""

    key: str
    tier: str  # the name of the tier it is read from
    codec: str
    dtype: torch.dtype  # what layers come back in by default: the model's
    shape: tuple[int, int, int, int]  # [L, H, T, D]
    num_layers: int
    token_ids: torch.Tensor  # [T]
    position: int
    context_hash: str
    fingerprint: str

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError


class ResidentEntry(_EntryInfo):
    """A chunk a tensor tier holds (keys/values [L, H, T, D] on the tier's device, model dtype)."""

    def __init__(self, key: str, tier: str, codec: str, kv: ChunkKV, hooks: EntryHooks) -> None:
        self.key, self.tier, self.codec, self.kv, self._hooks = key, tier, codec, kv, hooks
        self.dtype, self.shape = kv.keys.dtype, tuple(kv.keys.shape)
        self.num_layers = self.shape[0]
        self.token_ids, self.position = kv.token_ids, kv.position
        self.context_hash, self.fingerprint = kv.context_hash, kv.fingerprint
        self.nbytes = kv.nbytes
        self._read: set[int] = set()
        self._closed = False

    def layer(self, i: int, device: torch.device | None = None, dtype: torch.dtype | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The held tensors of layer `i` (no copy when already on `device` in `dtype`)."""
        if not 0 <= i < self.num_layers:
            raise IndexError(f"layer {i} out of range: the entry has {self.num_layers} layers")
        start = time.perf_counter()
        k, v = self.kv.keys[i], self.kv.values[i]  # [H, T, D] each
        k, v = k.to(device, dtype, non_blocking=True), v.to(device, dtype, non_blocking=True)
        self._read.add(i)
        self._hooks.layer_read(k.nbytes + v.nbytes, time.perf_counter() - start)
        return k, v

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if len(self._read) == self.num_layers and self._hooks.wants_tensors:
                self._hooks.promote(self.kv, None)


class LayeredEntry(_EntryInfo):
    """A stored ChunkKV in a byte tier opened for per-layer reads. Use as a context manager, or close() it.

    Attributes as ResidentEntry's, plus nbytes (the stored entry) and layer_nbytes (one layer's
    section). `layer(i)` may be called from any thread, in any order.
    """

    def __init__(self, key: str, tier: str, head: EntryHead, head_bytes: bytes, reader: RangeReader,
                 hooks: EntryHooks, *, verify: bool = True, pin_memory: bool = False,
                 pool: Executor | None = None, ahead: int = 2) -> None:
        self.key, self.tier, self._head, self._reader, self._hooks = key, tier, head, reader, hooks
        self.codec, self.dtype = head.codec, head.dtype
        self.shape, self.num_layers = head.shape, head.num_layers
        self.token_ids = head.token_ids
        self.position = head.header["position"]
        self.context_hash = head.header["context_hash"]
        self.fingerprint = head.header["fingerprint"]
        self.nbytes = head.nbytes
        self.layer_nbytes = head.layer_range(0)[1] if head.num_layers else 0
        self._verify = verify
        # Page-locked staging only means something (and only works) with CUDA.
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self._pool, self._ahead = pool, max(1, ahead)
        self._lock = threading.Lock()
        self._pending: dict[int, Future] = {}
        self._failed: str | None = None
        self._corrupt = False  # the failure was damage (the entry is dropped), not absence
        self._closed = False
        # Kept for promotion, only when a faster tier would take them: sections (bytes) and
        # host layers in the model's dtype.
        self._sections: dict[int, torch.Tensor] | None = {} if hooks.wants_bytes else None
        self._layers: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = {} if hooks.wants_tensors else None
        self._head_bytes = head_bytes
        for i in range(min(self._ahead, self.num_layers)):
            self.prefetch(i)

    def prefetch(self, i: int) -> None:
        """Queue layer i's read and check on the store's read pool (no pool, or queued already: nothing)."""
        if self._pool is None or not 0 <= i < self.num_layers:
            return
        with self._lock:
            if self._closed or self._failed is not None or i in self._pending:
                return
            try:
                self._pending[i] = self._pool.submit(self._read_checked, i)
            except RuntimeError:  # the store closed its pool: layers are read when asked
                self._pool = None

    def layer(self, i: int, device: torch.device | None = None, dtype: torch.dtype | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys [H, T, D], values [H, T, D]) of layer `i`: read, checked and unpacked on `device`
        in `dtype` (default: the model's dtype, on the host).

        Raises LayerReadError (the chunk is a miss) and IndexError for a layer out of range.
        """
        self._head.layer_range(i)  # IndexError first
        with self._lock:
            if self._failed is not None or self._closed:
                raise LayerReadError(f"entry {self.key[:12]}: {self._failed or 'closed'}", corrupt=self._corrupt)
            pending = self._pending.pop(i, None)
        self.prefetch(i + self._ahead)
        start = time.perf_counter()
        section = pending.result() if pending is not None else self._read_checked(i)
        on_host = (device is None or torch.device(device).type == "cpu") and dtype in (None, self.dtype)
        host = self._head.unpack_layer(section) if self._layers is not None or on_host else None
        keys, values = host if on_host else self._head.unpack_layer(section, device, dtype)
        self._hooks.layer_read(self.layer_nbytes, time.perf_counter() - start)
        with self._lock:
            if self._sections is not None:
                self._sections[i] = section
            if self._layers is not None:
                self._layers[i] = host
        return keys, values

    def _read_checked(self, i: int) -> torch.Tensor:
        """Layer i's section, read and checked: a uint8 tensor [length] (pinned when asked)."""
        offset, length = self._head.layer_range(i)
        section = torch.empty(length, dtype=torch.uint8, pin_memory=self.pin_memory)
        buffer = section.numpy()
        try:
            got = _read_into(self._reader, offset, buffer)
        except OSError as exc:
            self._fail(f"read failed: {exc}")
            raise LayerReadError(f"entry {self.key[:12]} in {self.tier}: reading layer {i} failed: {exc}",
                                 corrupt=False) from exc
        try:
            if got != length:
                raise LayerReadError(f"entry {self.key[:12]} went away from {self.tier} while being read",
                                     corrupt=False)
            if self._verify:
                self._head.check_layer(i, buffer)
        except CorruptEntryError as exc:
            if self._fail(f"layer {i} is damaged: {exc}", corrupt=True):  # two threads on a bad entry: dropped once
                self._hooks.dropped(exc)
            raise LayerReadError(f"entry {self.key[:12]} in {self.tier}: layer {i} is damaged ({exc}); "
                                 "the entry was dropped", corrupt=True) from exc
        except LayerReadError as exc:
            self._fail(str(exc))
            raise
        return section

    def _fail(self, reason: str, corrupt: bool = False) -> bool:
        """Mark the entry failed; True for the first failure."""
        with self._lock:
            first, self._failed = self._failed is None, self._failed or reason
            self._corrupt = self._corrupt or (first and corrupt)
            self._sections = self._layers = None
            return first

    def close(self) -> None:
        """Release the tier's handle (after any read still queued); promote the entry if every
        layer was read. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending, self._pending = list(self._pending.values()), {}
            sections, self._sections = self._sections, None
            layers, self._layers = self._layers, None
        for future in pending:
            if not future.cancel():
                future.exception()  # wait: the reader must outlive its reads
        self._reader.close()
        complete = lambda parts: parts is not None and len(parts) == self.num_layers  # noqa: E731
        if complete(sections) or complete(layers):
            self._hooks.promote(self._stacked(layers) if complete(layers) else None,
                                self._joined(sections) if complete(sections) else None)

    def _joined(self, sections: dict[int, torch.Tensor]) -> bytes:
        return b"".join([self._head_bytes, *(sections[i].numpy().tobytes() for i in range(self.num_layers))])

    def _stacked(self, layers: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> ChunkKV:
        _, H, T, D = self.shape
        empty = torch.empty((0, H, T, D), dtype=self.dtype)
        keys = torch.stack([layers[i][0] for i in range(self.num_layers)]) if layers else empty  # [L, H, T, D]
        values = torch.stack([layers[i][1] for i in range(self.num_layers)]) if layers else empty
        return ChunkKV(keys, values, self.token_ids, self.position, self.context_hash, self.fingerprint)


def _read_into(reader: RangeReader, offset: int, buffer) -> int:
    """Fill `buffer` (a writable uint8 array) from `offset`; the number of bytes read."""
    read_into = getattr(reader, "read_into", None)
    if read_into is not None:
        return read_into(offset, buffer)
    data = reader.read(offset, len(buffer))
    n = min(len(data), len(buffer))
    memoryview(buffer)[:n] = memoryview(data)[:n]
    return len(data)


def pread_into(fd: int, offset: int, buffer) -> int:
    """os.preadv until `buffer` is full or the file ends (releases the GIL)."""
    view, done = memoryview(buffer).cast("B"), 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done
