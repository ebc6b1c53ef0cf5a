"""Which tiers take a chunk a request stored from its prompt (TieredStore.put_nowait).

A prompt seen once (a one-off question, a pasted document nobody sends again) should not push the KV that
recurs out of the lower tiers, which are shared and slow to refill. Policies (`store.admission`):

    everywhere     every tier takes every chunk (the store before admission).
    second_sight   the tensor tiers (gpu, memory) take a chunk on first sight; the byte tiers (disk, Redis)
                   on its second: the key was put or hit before, within the last `window` keys sighted. A
                   chunk first seen in memory is written down when it is hit there again. A leased key is
                   admitted everywhere at once. A store with no tensor tier (memory_bytes 0) puts first
                   sights in its fastest tier.
    frequency      second_sight that filters only under pressure (TinyLFU's comparison, with exact counts): a
                   byte tier also takes a first sight while it has free room, or when every entry the write
                   would evict there was never re-used (sighted once within the window: a one-off only
                   displaces one-offs). A tier that cannot tell what it would evict (Redis) keeps second_sight.
                   So a passage seen once is still on disk many prompts later, while one-off traffic cannot
                   flush the KV that recurs.

Explicit puts (TieredStore.put: uploads' precompute, the prompt head, a passage computed on a miss) are
admitted everywhere: a document someone uploaded is useful by intent. bench/admission.py measured the choice.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Literal

AdmissionPolicy = Literal["everywhere", "second_sight", "frequency"]
TENSOR_TIERS = ("gpu", "memory")  # a byte tier is anything else (disk, redis, tests' BytesTier)


class Sightings:
    """How often each of the last `window` keys was put or hit: an LRU of keys and counts (exact, bounded:
    ~150 bytes a key, ~10 MB for the default window)."""

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError(f"the admission window must hold at least one key, got {window}")
        self.window = window
        self._counts: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def sight(self, key: str) -> int:
        """Count one sighting of `key`; how many there have been (this one included) within the window."""
        with self._lock:
            count = self._counts.pop(key, 0) + 1
            self._counts[key] = count
            if len(self._counts) > self.window:
                self._counts.popitem(last=False)
            return count

    def count(self, key: str) -> int:
        with self._lock:
            return self._counts.get(key, 0)


class Admission:
    """A policy over one store's tiers: `admitted(key, tier)` says whether `tier` takes `key` now."""

    def __init__(self, policy: AdmissionPolicy = "everywhere", window: int = 65536) -> None:
        self.policy = policy
        self.sightings = Sightings(window)

    @property
    def filters(self) -> bool:
        return self.policy != "everywhere"

    def sight(self, key: str) -> int:
        return self.sightings.sight(key) if self.filters else 0

    def admitted(self, key: str, tier: str, leased: bool = False, fastest: bool = False,
                 victims: Callable[[], list[str] | None] = lambda: None) -> bool:
        """Whether `tier` takes `key` (sighted by now): always under `everywhere`, a tensor tier (or the store's
        `fastest`) always, a byte tier once the key was sighted twice or while a lease holds it; under
        `frequency` also when what it would evict there, `victims()` (None: unknown), was never re-used."""
        if not self.filters or tier in TENSOR_TIERS or fastest or leased or self.sightings.count(key) >= 2:
            return True
        if self.policy != "frequency":
            return False
        evicted = victims()
        return evicted is not None and all(self.sightings.count(old) < 2 for old in evicted)
