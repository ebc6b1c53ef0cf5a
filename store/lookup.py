"""The store's reads: one walk over the tiers for every lookup, and promotion of hits, behind TieredStore.

    get:  walk the tiers in order; the first entry that passes its checks wins and is put into the faster tiers
          (promotion). An entry that fails (damaged, another model's, not the KV its key names) is deleted from
          that tier, counted as `corrupt`, and the walk goes on as if it were a miss. Entries of another format
          version are dropped the same way but counted as `stale` (an upgrade, not damage). A chunk the writer
          still holds pending is a hit in the fastest tier (store/writer.py).
    open: the same walk, reading only the head; layers are then read one by one (an OpenEntry), and an entry
          read to the end is promoted when it is closed.
A hit renews the entry's soft leases, and a second sight in a tensor tier queues a write-down (store/writer.py).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from common.chunk_kv import ChunkKV, KVMismatchError
from store.admission import TENSOR_TIERS, Admission
from store.base import Entry, OpenEntry, Reading, Tier
from store.counters import StoreCounters
from store.layered import ResidentEntry
from store.leases import Leases
from store.serialize import CorruptEntryError, OldFormatError
from store.writer import Writer

log = logging.getLogger("ragblend.store")
Found = TypeVar("Found", Entry, OpenEntry)


class Lookup:
    """Reads over `tiers` (fastest first) and the writer's pending chunks; thread-safe."""

    def __init__(self, tiers: Sequence[Tier], codecs: dict[str, str], readings: dict[str, Reading],
                 counters: StoreCounters, admission: Admission, writer: Writer, leases: Leases | None,
                 closed: Callable[[], bool]) -> None:
        """`codecs`: tier name -> its codec's name; `closed()`: the store is closed (no promotion then)."""
        self.tiers, self.codecs, self._readings = list(tiers), codecs, readings
        self.counters, self._admission, self._writer = counters, admission, writer
        self._leases, self._closed = leases, closed

    def _walk(self, key: str, read: Callable[[int, Tier], Found | None], pending: Callable[[Entry], Found],
              only: str | None = None) -> tuple[int, Found] | None:
        """The first tier's hit, `read(index, tier)`, with that tier's index; None on a miss everywhere.
        A chunk still pending is a hit in the fastest tier, `pending(entry)`. A bad entry is dropped and the
        walk goes on. `only`: that tier alone."""
        if only is not None and only not in self.codecs:
            raise ValueError(f"no tier {only!r}: the store has {list(self.codecs)}")
        self.counters.bump("gets")
        if self.tiers and only in (None, self.tiers[0].name) and (held := self._writer.pending_entry(key)) is not None:
            start = time.perf_counter()
            found = pending(held)
            self.counters.looked_up(self.tiers[0].name, time.perf_counter() - start)
            self.counters.bump("hits")
            self.counters.bump("pending_hits")
            self._admission.sight(key)  # a second sight before the write runs: it asks when it runs
            return 0, found
        for i, tier in enumerate(self.tiers):
            if only is not None and tier.name != only:
                continue
            start = time.perf_counter()
            try:
                found = read(i, tier)
            except (CorruptEntryError, KVMismatchError) as exc:
                self.drop(tier, key, exc)
                found = None
            self.counters.looked_up(tier.name, None if found is None else time.perf_counter() - start)
            if found is not None:
                log.debug("store: hit %s in %s", key[:12], tier.name)
                self.counters.bump("hits")
                if self._leases is not None:
                    self._leases.hit(key)  # its soft leases run again
                if self._admission.sight(key) == 2 and tier.name in TENSOR_TIERS:
                    self._writer.write_down(key, i)  # second sight: the tiers below may take it now
                return i, found
        self.counters.bump("misses")
        return None

    def get_with_tier(self, key: str) -> tuple[ChunkKV | None, str | None]:
        """The entry and the name of the tier it was found in (None, None on a miss)."""
        found = self._walk(key, lambda i, tier: tier.get(key, self._readings[tier.name]), lambda entry: entry)
        if found is None:
            return None, None
        index, entry = found
        self.promote(key, index, entry)
        return entry.kv, self.tiers[index].name

    def open(self, key: str, tier: str | None = None) -> OpenEntry | None:
        """The entry under `key` opened for per-layer reads, or None on a miss (TieredStore.open)."""
        fastest = self.tiers[0].name if self.tiers else ""
        found = self._walk(key, lambda i, t: t.open(key, self._readings[t.name], _Hooks(self, i, key)),
                           lambda entry: ResidentEntry(key, fastest, self.codecs[fastest], entry.kv,
                                                       _Hooks(self, 0, key)),
                           only=tier)
        return None if found is None else found[1]

    def contains(self, key: str, tier: str | None = None) -> bool:
        """Whether any tier (or `tier`) holds `key`, or it is pending, without reading it."""
        if tier is None and self._writer.pending(key) is not None:
            return True
        return any(t.contains(key) for t in self.tiers if tier is None or t.name == tier)

    def any_entry(self, key: str) -> Entry | None:
        """The entry pending, or from the first tier that holds a good one (no promotion, no lookup counted)."""
        if (held := self._writer.pending_entry(key)) is not None:
            return held
        for tier in self.tiers:
            try:
                entry = tier.get(key, self._readings[tier.name])
            except (CorruptEntryError, KVMismatchError) as exc:
                self.drop(tier, key, exc)
                continue
            if entry is not None:
                return entry
        return None

    def drop(self, tier: Tier, key: str, exc: Exception) -> None:
        """Delete a bad entry from `tier` and count it (another format version: quietly)."""
        stale = isinstance(exc, OldFormatError)
        log.log(logging.DEBUG if stale else logging.WARNING, "store: dropping %s entry %s from %s: %s",
                "old" if stale else "bad", key[:12], tier.name, exc)
        tier.delete(key)
        self.counters.dropped(tier.name, stale)

    def promote(self, key: str, found_at: int, entry: Entry) -> None:
        """Put an entry found in tier `found_at` into the faster tiers (not after close)."""
        if not self._closed():
            for tier in self.tiers[:found_at]:
                tier.put(key, entry)


class _Hooks:
    """What an entry opened from tier `index` reports back (store.base.EntryHooks)."""

    def __init__(self, lookup: Lookup, index: int, key: str) -> None:
        self._lookup, self._index, self._key = lookup, index, key
        self.promotes = index > 0

    def dropped(self, exc: Exception) -> None:
        self._lookup.drop(self._lookup.tiers[self._index], self._key, exc)

    def layer_read(self, nbytes: int, seconds: float) -> None:
        self._lookup.counters.layer_read(self._lookup.tiers[self._index].name, nbytes, seconds)

    def layer_decoded(self, codec: str, nbytes: int, tokens: int, seconds: float) -> None:
        self._lookup.counters.layer_decoded(codec, nbytes, tokens, seconds)

    def promote(self, entry: Entry) -> None:
        self._lookup.promote(self._key, self._index, entry)
