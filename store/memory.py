"""In-process tiers, LRU under a byte cap, thread-safe.

`MemoryTier` holds tensors: each chunk's keys/values [L, H, T, D] in the model's dtype on the tier's
device: host memory (page-locked where the model runs on CUDA, so a layer's copy to the GPU is
one non-blocking DMA), or the GPU itself (the `gpu` tier). Entries are placed once, when they are
put or promoted (pinned buffers come from torch's caching host allocator, which reuses freed
page-locked blocks: nothing is pinned per read), and handed out as they are: a hit is no copy and
no decode. `BytesTier` holds serialized entries (a stand-in remote tier for tests and benchmarks).
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import torch

from common.chunk_kv import ChunkKV
from store.eviction import LRUPolicy
from store.keys import validate_key
from store.serialize import host_to


class MemoryReader:
    """Byte ranges of one entry: slices of its immutable bytes, no copy."""

    def __init__(self, data: bytes) -> None:
        self._view = memoryview(data)

    def read(self, offset: int, length: int) -> memoryview:
        return self._view[offset:offset + length]

    def close(self) -> None:
        pass


class _LRUEntries:
    """Entries in a dict under an LRU byte cap, thread-safe: what both in-process tiers share."""

    remote = False
    trusted = True  # what is held here never left this process: the store may skip re-checking digests

    def __init__(self, capacity_bytes: int) -> None:
        self._data: dict[str, Any] = {}
        self._lru = LRUPolicy(capacity_bytes)
        self._lock = threading.Lock()
        self._evictions = 0

    def get(self, key: str) -> Any:
        """The entry (bytes or a ChunkKV, as the tier holds), refreshing its recency; None on a miss."""
        validate_key(key)
        with self._lock:
            entry = self._data.get(key)
            if entry is not None:
                self._lru.touch(key)
            return entry

    def _hold(self, key: str, entry: Any, nbytes: int) -> None:
        with self._lock:
            self._data[key] = entry
            for old in self._lru.add(key, nbytes):
                del self._data[old]
                self._evictions += 1

    def delete(self, key: str) -> bool:
        validate_key(key)
        with self._lock:
            self._lru.remove(key)
            return self._data.pop(key, None) is not None

    def contains(self, key: str) -> bool:
        validate_key(key)
        with self._lock:
            return key in self._data

    def keys(self) -> Iterator[str]:
        with self._lock:
            return iter(self._lru.keys())

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"entries": len(self._data), "bytes": self._lru.nbytes, "capacity": self._lru.capacity,
                    "evictions": self._evictions, "errors": 0}


class BytesTier(_LRUEntries):
    name = "bytes"

    def head(self, key: str, nbytes: int) -> bytes | None:
        """The first `nbytes` of an entry, without touching its recency."""
        validate_key(key)
        with self._lock:
            data = self._data.get(key)
        return None if data is None else data[:nbytes]

    def reader(self, key: str) -> MemoryReader | None:
        """Open an entry for byte-range reads (refreshes its recency once)."""
        data = self.get(key)
        return None if data is None else MemoryReader(data)

    def put(self, key: str, data: bytes) -> None:
        validate_key(key)
        data = bytes(data)  # immutable: nobody can change an entry behind the store's back
        if self._lru.fits(len(data)):
            self._hold(key, data, len(data))

    def close(self) -> None:
        pass


class MemoryTier(_LRUEntries):
    """ChunkKVs held as tensors on `device` (see the module doc). `pin_memory`: host buffers are
    page-locked (only with CUDA present)."""

    holds_tensors = True

    def __init__(self, capacity_bytes: int, device: torch.device | str = "cpu", name: str = "memory",
                 pin_memory: bool = False) -> None:
        super().__init__(capacity_bytes)
        self.name, self.device = name, torch.device(device)
        self.pin_memory = pin_memory and self.device.type == "cpu" and torch.cuda.is_available()

    def _placed(self, t: torch.Tensor) -> torch.Tensor:
        """`t` on the tier's device, contiguous (and pinned when asked): `t` itself when it already is."""
        if t.device == self.device and t.is_contiguous() and (not self.pin_memory or t.is_pinned()):
            return t
        placed = torch.empty(t.shape, dtype=t.dtype, device=self.device, pin_memory=self.pin_memory)
        return host_to(t, t.dtype, out=placed) if self.device.type == "cpu" and t.device.type == "cpu" \
            else placed.copy_(t)

    def put(self, key: str, kv: ChunkKV) -> None:
        """Hold `kv` (its tensors themselves when already placed: the store hands over fresh ones)."""
        validate_key(key)
        if not self._lru.fits(kv.nbytes):
            return
        held = ChunkKV(self._placed(kv.keys), self._placed(kv.values), kv.token_ids, kv.position,
                       kv.context_hash, kv.fingerprint)
        self._hold(key, held, held.nbytes)

    def close(self) -> None:
        with self._lock:
            self._data.clear()
            self._lru = LRUPolicy(self._lru.capacity)

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "device": str(self.device), "pinned": self.pin_memory}
