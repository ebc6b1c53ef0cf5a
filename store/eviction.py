"""Eviction policy shared by the local tiers: least recently used, under a byte cap."""
from __future__ import annotations

from collections import OrderedDict


class LRUPolicy:
    """Recency order and byte total of a tier's entries.

    Holds sizes only: the tier keeps the data and the lock, and drops whatever `add` evicts.
    Not thread-safe by itself.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.nbytes = 0
        self._sizes: OrderedDict[str, int] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, key: str) -> bool:
        return key in self._sizes

    def keys(self) -> list[str]:
        return list(self._sizes)

    def fits(self, size: int) -> bool:
        return size <= self.capacity

    def touch(self, key: str) -> None:
        if key in self._sizes:
            self._sizes.move_to_end(key)

    def add(self, key: str, size: int) -> list[str]:
        """Record `key` as most recently used; return the keys evicted to get back under the cap.

        An entry larger than the whole cap evicts only itself (check `fits` first to skip the work).
        """
        self.remove(key)
        if not self.fits(size):
            return [key]
        self._sizes[key] = size
        self.nbytes += size
        evicted = []
        while self.nbytes > self.capacity:
            old, old_size = self._sizes.popitem(last=False)
            self.nbytes -= old_size
            evicted.append(old)
        return evicted

    def remove(self, key: str) -> bool:
        size = self._sizes.pop(key, None)
        if size is None:
            return False
        self.nbytes -= size
        return True
