"""One stored chunk, read a layer at a time: what a pipelined prefill loads while it computes.

`TieredStore.open(key)` returns a LayerSource (blend.pipeline's contract, `layer(i, device, dtype)`):

- from a byte tier (disk, Redis) a `LayeredEntry`: the head (header, token ids) was read and
  checked at open; `layer(i)` reads layer i into a staging buffer (page-locked where the store's
  placement says `pin`), checks its xxh3 digest and unpacks it on the model's device. With a read
  pool it reads ahead: opening queues layers 0..ahead-1 and each `layer(i)` queues layer i+ahead, so
  while the loader takes layer i of every chunk in turn, every chunk's next layers are already being
  read concurrently (file reads and copies release the GIL): a layer's load is bounded by the tier's
  bandwidth, not one thread, and the loader needs no change.
- from a tensor tier (memory, gpu) a `ResidentEntry`: layer i is the tensor the tier holds,
  handed over without a copy when it is already on the device in the dtype.

A layer that fails its checksum raises `LayerReadError` and the entry is dropped from that tier
(counted as corrupt): the caller recomputes the chunk, it never gets wrong KV.

Promotion: an entry whose every layer was read and checked is offered to the faster tiers when it
is closed, as one store.base.Entry (a LayeredEntry keeps the sections it read for that, so it costs
no second read); one closed earlier is not. The store hands each entry its EntryHooks (drop, count,
promote): this module knows no store.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future
from typing import Protocol

import torch

from common.chunk_kv import ChunkKV
from store.base import Entry, EntryHooks, OpenEntry, Reading
from store.serialize import Codec, CorruptEntryError, EntryHead, get_codec

log = logging.getLogger("ragblend.store")


class RangeReader(Protocol):
    """Byte ranges of one stored entry, as a tier's `reader(key)` opens it. Thread-safe.
    Optionally `read_into(offset, buffer) -> int` (bytes read) fills a writable buffer in place."""

    def read(self, offset: int, length: int) -> bytes | memoryview: ...  # fewer bytes past the end
    def close(self) -> None: ...


class LayerReadError(RuntimeError):
    """A layer could not be read: treat the chunk as a miss. `corrupt`: its bytes were damaged
    (the store has dropped the entry); otherwise the entry went away (deleted, expired, Redis
    unreachable) while it was being read."""

    def __init__(self, message: str, corrupt: bool) -> None:
        super().__init__(message)
        self.corrupt = corrupt


class ResidentEntry(OpenEntry):
    """A chunk a tensor tier holds (keys/values [L, H, T, D] on the tier's device, model dtype)."""

    resident = True

    def __init__(self, key: str, tier: str, codec: str | Codec, kv: ChunkKV, hooks: EntryHooks) -> None:
        self.key, self.tier, self.kv, self._hooks = key, tier, kv, hooks
        self._coder = get_codec(codec)  # encodes the entry if it is promoted into a byte tier
        self.codec = self._coder.name
        self.dtype, self.shape = kv.keys.dtype, tuple(kv.keys.shape)
        self.num_layers = self.shape[0]
        self.token_ids, self.position = kv.token_ids, kv.position
        self.context_hash, self.fingerprint = kv.context_hash, kv.fingerprint
        self.nbytes = kv.nbytes
        self.layer_nbytes = self.nbytes // self.num_layers if self.num_layers else 0
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

    def held(self, device: torch.device | None = None, dtype: torch.dtype | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's held tensors (keys, values [L, H, T, D]; no copy when already on `device` in `dtype`)."""
        start = time.perf_counter()
        k, v = self.kv.keys.to(device, dtype, non_blocking=True), self.kv.values.to(device, dtype, non_blocking=True)
        self._read.update(range(self.num_layers))
        self._hooks.layer_read(k.nbytes + v.nbytes, time.perf_counter() - start)
        return k, v

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if len(self._read) == self.num_layers and self._hooks.promotes:
                self._hooks.promote(Entry.of_tensors(self.kv, self._coder))


class LayeredEntry(OpenEntry):
    """A stored ChunkKV in a byte tier opened for per-layer reads. `layer(i)` may be called from any
    thread, in any order."""

    def __init__(self, key: str, tier: str, head: EntryHead, head_bytes: bytes, reader: RangeReader,
                 hooks: EntryHooks, *, verify: bool = True, reading: Reading = Reading()) -> None:
        self.key, self.tier, self._head, self._reader, self._hooks = key, tier, head, reader, hooks
        self.codec, self.dtype = head.codec, head.dtype
        self.shape, self.num_layers = head.shape, head.num_layers
        self.token_ids = head.token_ids
        self.position = head.header["position"]
        self.context_hash = head.header["context_hash"]
        self.fingerprint = head.header["fingerprint"]
        self.nbytes = head.nbytes
        self.layer_nbytes = (head.nbytes - head.head_nbytes) // max(head.num_layers, 1)  # a mean: some codecs vary
        self._verify = verify
        self.pin_memory = reading.placement.pin  # staging buffers a copy to the device can read without blocking
        self._pool, self._ahead = reading.pool, max(1, reading.ahead)
        self._lock = threading.Lock()
        self._pending: dict[int, Future] = {}
        self._failed: str | None = None
        self._corrupt = False  # the failure was damage (the entry is dropped), not absence
        self._closed = False
        # The sections read, kept for promotion when a faster tier would take the entry.
        self._sections: dict[int, torch.Tensor] | None = {} if hooks.promotes else None
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
        section, parts, read_s, decode_s = pending.result() if pending is not None else self._read_checked(i)
        start = time.perf_counter()
        keys, values = self._head.unpack_parts(parts, device, dtype)
        self._hooks.layer_read(len(section), read_s)  # the tier's bandwidth and the codec's decode rate, apart
        self._hooks.layer_decoded(self.codec, len(section), self.shape[2], decode_s + time.perf_counter() - start)
        with self._lock:
            if self._sections is not None:
                self._sections[i] = section
        return keys, values

    def _read_checked(self, i: int) -> tuple[torch.Tensor, dict[str, torch.Tensor], float, float]:
        """Layer i's section, read and checked (a uint8 tensor [length], pinned when asked), its parts on the
        host (an entropy-coded layer decoded here, on the read thread: off the loader's), and the seconds the
        read + check and the host decode took."""
        start = time.perf_counter()
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
            read = time.perf_counter()
            parts = self._head.layer_parts(i, section)
        except CorruptEntryError as exc:
            if self._fail(f"layer {i} is damaged: {exc}", corrupt=True):  # two threads on a bad entry: dropped once
                self._hooks.dropped(exc)
            raise LayerReadError(f"entry {self.key[:12]} in {self.tier}: layer {i} is damaged ({exc}); "
                                 "the entry was dropped", corrupt=True) from exc
        except LayerReadError as exc:
            self._fail(str(exc))
            raise
        return section, parts, read - start, time.perf_counter() - read

    def _fail(self, reason: str, corrupt: bool = False) -> bool:
        """Mark the entry failed; True for the first failure."""
        with self._lock:
            first, self._failed = self._failed is None, self._failed or reason
            self._corrupt = self._corrupt or (first and corrupt)
            self._sections = None
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
        for future in pending:
            if not future.cancel():
                future.exception()  # wait: the reader must outlive its reads
        self._reader.close()
        if sections is not None and len(sections) == self.num_layers:
            data = b"".join([self._head_bytes, *(sections[i].numpy().tobytes() for i in range(self.num_layers))])
            self._hooks.promote(Entry.of_bytes(data))  # every section checked: the very bytes, reassembled


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
