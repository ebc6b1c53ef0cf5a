"""In-process tiers, LRU under a byte cap (passing over the keys leases hold), thread-safe.

`MemoryTier` keeps tensors: each chunk's keys/values [L, H, T, D] in the model's dtype on the tier's
device: host memory (page-locked when the placement says `pin`, so a layer's copy to the device is one
non-blocking DMA), or the device itself (the `gpu` tier). Entries are placed once, when they are put or
promoted (pinned buffers come from torch's caching host allocator, which reuses freed page-locked
blocks: nothing is pinned per read), and handed out as they are: a hit is no copy and no decode.
`BytesTier` keeps encoded entries (a stand-in remote tier for tests and benchmarks).
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import torch

from common.chunk_kv import ChunkKV
from common.placement import HOST
from store.base import Entry, EntryHooks, Reading, Tier
from store.byte_tier import ByteTier
from store.eviction import LRUPolicy, Pinned, never_pinned
from store.keys import validate_key
from store.layered import ResidentEntry


class MemoryReader:
    """Byte ranges of one entry: slices of its immutable bytes, no copy."""

    def __init__(self, data: bytes) -> None:
        self._view = memoryview(data)

    def read(self, offset: int, length: int) -> memoryview:
        return self._view[offset:offset + length]

    def close(self) -> None:
        pass


class LRUEntries:
    """Entries in a dict under an LRU byte cap that passes over leased keys (`pinned`), thread-safe: what
    both in-process tiers keep theirs in."""

    def __init__(self, capacity_bytes: int, pinned: Pinned = never_pinned) -> None:
        self._data: dict[str, Any] = {}
        self._lru = LRUPolicy(capacity_bytes, pinned)
        self._lock = threading.Lock()
        self._evictions = 0

    def fits(self, nbytes: int) -> bool:
        return self._lru.fits(nbytes)

    def victims(self, nbytes: int) -> list[str] | None:
        with self._lock:
            return self._lru.victims(nbytes)

    def get(self, key: str, touch: bool = True) -> Any:
        """The entry, refreshing its recency (unless `touch` is False); None on a miss."""
        validate_key(key)
        with self._lock:
            entry = self._data.get(key)
            if entry is not None and touch:
                self._lru.touch(key)
            return entry

    def hold(self, key: str, entry: Any, nbytes: int) -> None:
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

    def size_of(self, key: str) -> int | None:
        validate_key(key)
        with self._lock:
            return self._lru.size_of(key)

    def keys(self) -> Iterator[str]:
        with self._lock:
            return iter(self._lru.keys())

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._lru = LRUPolicy(self._lru.capacity, self._lru.pinned)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"entries": len(self._data), "bytes": self._lru.nbytes, "capacity": self._lru.capacity,
                    "evictions": self._evictions, "lease_held": self._lru.held, "errors": 0}


class MemoryTier(Tier):
    """ChunkKVs kept as tensors on `device` (see the module doc); `pin`: host buffers are page-locked
    (the store's placement decides: only where the model's device reads host memory by DMA); `pinned`:
    the keys leases hold here, which LRU passes over (store.leases)."""

    def __init__(self, capacity_bytes: int, device: torch.device | str = HOST.device, name: str = "memory",
                 pin: bool = False, pinned: Pinned = never_pinned) -> None:
        self._entries = LRUEntries(capacity_bytes, pinned)
        self.name, self.pin = name, pin
        self.device = torch.empty(0, device=device).device  # as tensors name it ("cuda" -> "cuda:0")

    def held(self, key: str) -> ChunkKV | None:
        """The tensors kept under `key` (refreshing its recency), as every hit hands them out."""
        return self._entries.get(key)

    def get(self, key: str, reading: Reading = Reading()) -> Entry | None:
        kv = self.held(key)
        return None if kv is None else Entry.of_tensors(kv, reading.codec)

    def open(self, key: str, reading: Reading, hooks: EntryHooks) -> ResidentEntry | None:
        kv = self.held(key)
        return None if kv is None else ResidentEntry(key, self.name, reading.codec, kv, hooks)

    def _placed(self, t: torch.Tensor) -> torch.Tensor:
        """`t` on the tier's device, contiguous (and pinned when asked): `t` itself when it already is."""
        if t.device == self.device and t.is_contiguous() and (t.is_pinned() or not self.pin):
            return t
        return torch.empty(t.shape, dtype=t.dtype, device=self.device, pin_memory=self.pin).copy_(t)

    def put(self, key: str, entry: Entry) -> None:
        """Keep the entry's tensors (themselves when already placed: the store hands over fresh ones)."""
        validate_key(key)
        kv = entry.kv
        if not self._entries.fits(kv.nbytes):
            return
        held = ChunkKV(self._placed(kv.keys), self._placed(kv.values), kv.token_ids, kv.position,
                       kv.context_hash, kv.fingerprint)
        self._entries.hold(key, held, held.nbytes)

    def delete(self, key: str) -> bool:
        return self._entries.delete(key)

    def contains(self, key: str) -> bool:
        return self._entries.contains(key)

    def size_of(self, key: str) -> int | None:
        return self._entries.size_of(key)

    def footprint(self, entry: Entry) -> int:
        return entry.kv.nbytes

    def keys(self) -> Iterator[str]:
        return self._entries.keys()

    def fingerprint_of(self, key: str) -> str | None:
        kv = self._entries.get(key, touch=False)
        return None if kv is None else kv.fingerprint

    def close(self) -> None:
        self._entries.clear()

    def stats(self) -> dict[str, Any]:
        return {**self._entries.stats(), "device": str(self.device), "pinned": self.pin}


class BytesTier(ByteTier):
    """Encoded entries in this process's memory. Trusted: its bytes never left the process."""

    name = "bytes"
    trusted = True

    def __init__(self, capacity_bytes: int, write_behind: int = 0, pinned: Pinned = never_pinned) -> None:
        super().__init__(write_behind)
        self._entries = LRUEntries(capacity_bytes, pinned)

    def get_bytes(self, key: str) -> bytes | None:
        return self._entries.get(key)

    def head(self, key: str, nbytes: int) -> bytes | None:
        data = self._entries.get(key, touch=False)
        return None if data is None else data[:nbytes]

    def reader(self, key: str) -> MemoryReader | None:
        data = self._entries.get(key)
        return None if data is None else MemoryReader(data)

    def put_bytes(self, key: str, data: bytes) -> None:
        validate_key(key)
        data = bytes(data)  # immutable: nobody can change an entry behind the store's back
        if self._entries.fits(len(data)):
            self._entries.hold(key, data, len(data))

    def remove(self, key: str) -> bool:
        return self._entries.delete(key)

    def contains(self, key: str) -> bool:
        return self._entries.contains(key)

    def size_of(self, key: str) -> int | None:
        return self._entries.size_of(key)

    def victims(self, nbytes: int) -> list[str] | None:
        return self._entries.victims(nbytes)

    def keys(self) -> Iterator[str]:
        return self._entries.keys()

    def stats(self) -> dict[str, Any]:
        return {**self._entries.stats(), **self.write_stats()}
