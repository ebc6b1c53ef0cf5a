"""In-process tier: serialized entries in a dict, LRU under a byte cap, thread-safe."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from store.eviction import LRUPolicy
from store.keys import validate_key


class MemoryReader:
    """Byte ranges of one entry: slices of its immutable bytes, no copy."""

    def __init__(self, data: bytes) -> None:
        self._view = memoryview(data)

    def read(self, offset: int, length: int) -> memoryview:
        return self._view[offset:offset + length]

    def close(self) -> None:
        pass


class MemoryTier:
    name = "memory"
    remote = False
    trusted = True  # bytes here never left this process: the store may skip re-checking the digest

    def __init__(self, capacity_bytes: int) -> None:
        self._data: dict[str, bytes] = {}
        self._lru = LRUPolicy(capacity_bytes)
        self._lock = threading.Lock()
        self._evictions = 0

    def get(self, key: str) -> bytes | None:
        validate_key(key)
        with self._lock:
            data = self._data.get(key)
            if data is not None:
                self._lru.touch(key)
            return data

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
        if not self._lru.fits(len(data)):
            return
        with self._lock:
            self._data[key] = data
            for old in self._lru.add(key, len(data)):
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

    def close(self) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"entries": len(self._data), "bytes": self._lru.nbytes, "capacity": self._lru.capacity,
                    "evictions": self._evictions, "errors": 0}
