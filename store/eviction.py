"""Eviction policy shared by the local tiers: least recently used, under a byte cap, passing over leased keys."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

Pinned = Callable[[str], bool]  # whether a running lease holds a key in this tier (store.leases.Leases.pinned_in)


def never_pinned(key: str) -> bool:
    return False


class LRUPolicy:
    """Recency order and byte total of a tier's entries.

    Holds sizes only: the tier keeps the data and the lock, and drops whatever `add` evicts. A key
    `pinned` names is never evicted: eviction passes over it (counted in `held`) to the next oldest.
    Not thread-safe by itself.
    """

    def __init__(self, capacity: int, pinned: Pinned = never_pinned) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity, self.pinned = capacity, pinned
        self.nbytes = 0
        self.held = 0  # evictions passed over a leased key
        self._sizes: OrderedDict[str, int] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, key: str) -> bool:
        return key in self._sizes

    def keys(self) -> list[str]:
        return list(self._sizes)

    def size_of(self, key: str) -> int | None:
        return self._sizes.get(key)

    def fits(self, size: int) -> bool:
        return size <= self.capacity

    def touch(self, key: str) -> None:
        if key in self._sizes:
            self._sizes.move_to_end(key)

    def add(self, key: str, size: int) -> list[str]:
        """Record `key` as most recently used; return the keys evicted to get back under the cap.

        An entry larger than the whole cap, or one that only leased entries stand in the way of, evicts
        only itself (nothing else is evicted for it; check `fits` first to skip the work).
        """
        self.remove(key)
        victims = self._victims(self.nbytes + size - self.capacity, count=True) if self.fits(size) else None
        if victims is None:
            return [key]
        for old in victims:
            self.remove(old)
        self._sizes[key] = size
        self.nbytes += size
        return victims

    def victims(self, size: int) -> list[str] | None:
        """The keys a new entry of `size` bytes would evict now ([]: it fits in the free room; None: it cannot
        fit). A question, nothing changes."""
        return self._victims(self.nbytes + size - self.capacity) if self.fits(size) else None

    def _victims(self, excess: int, count: bool = False) -> list[str] | None:
        """The least recent unleased keys that free `excess` bytes (None: the unleased ones cannot); `count`:
        the leased ones passed over are counted in `held`."""
        victims: list[str] = []
        for old, old_size in self._sizes.items():
            if excess <= 0:
                break
            if self.pinned(old):
                self.held += count
                continue
            victims.append(old)
            excess -= old_size
        return victims if excess <= 0 else None

    def remove(self, key: str) -> bool:
        size = self._sizes.pop(key, None)
        if size is None:
            return False
        self.nbytes -= size
        return True
