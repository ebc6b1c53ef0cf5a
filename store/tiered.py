"""The tier chain: gpu -> memory -> disk -> Redis, one walk for every lookup, promotion of hits, puts.

Every tier is a store.base.Tier and every entry a store.base.Entry, so the store never asks which form a
tier keeps (the memory and gpu tiers keep tensors, disk and Redis the encoded entry).

    get:  walk the tiers in order; the first entry that passes its checks wins and is put into the
          faster tiers (promotion). An entry that fails (damaged, another model's, not the KV its key
          names) is deleted from that tier, counted as `corrupt`, and the walk goes on as if it were a
          miss. Entries of another format version are dropped the same way but counted as `stale`
          (an upgrade, not damage).
    open: the same walk, reading only the head; layers are then read one by one (an OpenEntry), and
          an entry read to the end is promoted when it is closed.
    put:  one Entry to every tier: tensor tiers keep the KV as the codec will give it back
          (`Codec.round_trip`, returned to the caller), byte tiers its encoding, made once.
    delete: from every tier; it wins over any background write of that key queued before it.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from common.chunk_kv import ChunkKV, KVMismatchError
from common.placement import HOST, Placement
from store.base import Entry, OpenEntry, Reading, Tier
from store.counters import StoreCounters
from store.keys import kv_key, validate_key
from store.serialize import CorruptEntryError, OldFormatError

log = logging.getLogger("ragblend.store")
Found = TypeVar("Found", Entry, OpenEntry)


class KVStore(Protocol):
    """What the rest of ragblend needs from a KV store."""

    def get(self, key: str) -> ChunkKV | None: ...
    def open(self, key: str) -> OpenEntry | None: ...
    def put(self, key: str, kv: ChunkKV) -> ChunkKV: ...
    def delete(self, key: str) -> bool: ...
    def contains(self, key: str) -> bool: ...
    def stats(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


class StoreClosedError(RuntimeError):
    """The store was used after close()."""


class TieredStore:
    """ChunkKVs by key over a list of tiers, fastest first.

    `fingerprint` set: entries of any other model are refused on put and dropped on get.
    Every entry must sit under its own key, `kv_key(kv.fingerprint, kv.context_hash,
    kv.token_ids)`: put raises KVMismatchError otherwise, and get drops entries that don't.
    `placement` (the model's, common.placement): layers bound for its device are staged in
    page-locked memory when it says `pin`.
    Thread-safe. After close(), every call but close/flush/stats raises StoreClosedError.
    """

    def __init__(self, tiers: Sequence[Tier], codec: str = "fp16", fingerprint: str | None = None,
                 placement: Placement = HOST, read_threads: int = 4, read_ahead: int = 2) -> None:
        """`read_threads`: the pool that reads open entries' layers ahead, concurrently (0: each
        layer is read when asked, on the caller's thread); `read_ahead`: layers per entry queued ahead."""
        if len({t.name for t in tiers}) != len(tiers):
            raise ValueError(f"tier names must be unique: {[t.name for t in tiers]}")
        self.tiers = list(tiers)
        self.codec, self.fingerprint, self.placement = codec, fingerprint, placement
        self._pool = ThreadPoolExecutor(read_threads, thread_name_prefix="ragblend-store-read") if read_threads else None
        self._reading = Reading(codec, fingerprint, placement, self._pool, read_ahead)
        self._counters = StoreCounters(t.name for t in self.tiers)
        self._close_lock = threading.Lock()
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:  # a plain read: once True it stays True
            raise StoreClosedError("the KV store is closed")

    # --- reads ----------------------------------------------------------------------------------

    def _walk(self, key: str, read: Callable[[int, Tier], Found | None]) -> tuple[int, Found] | None:
        """The first tier's hit, `read(index, tier)`, with that tier's index; None on a miss everywhere.
        A bad entry is dropped and the walk goes on."""
        validate_key(key)
        self._check_open()
        self._counters.bump("gets")
        for i, tier in enumerate(self.tiers):
            start = time.perf_counter()
            try:
                found = read(i, tier)
            except (CorruptEntryError, KVMismatchError) as exc:
                self._drop(tier, key, exc)
                found = None
            self._counters.looked_up(tier.name, None if found is None else time.perf_counter() - start)
            if found is not None:
                log.debug("store: hit %s in %s", key[:12], tier.name)
                self._counters.bump("hits")
                return i, found
        self._counters.bump("misses")
        return None

    def get(self, key: str) -> ChunkKV | None:
        return self.get_with_tier(key)[0]

    def get_with_tier(self, key: str) -> tuple[ChunkKV | None, str | None]:
        """The entry and the name of the tier it was found in (None, None on a miss)."""
        found = self._walk(key, lambda i, tier: tier.get(key, self._reading))
        if found is None:
            return None, None
        index, entry = found
        self._promote(key, index, entry)
        return entry.kv, self.tiers[index].name

    def open(self, key: str) -> OpenEntry | None:
        """The entry under `key` opened for per-layer reads (a blend.pipeline.LayerSource), or None on a miss.

        From a tensor tier: its tensors, layer by layer. From a byte tier: reads and checks only the
        head (header, token ids, model, key); `entry.layer(i)` reads the rest, ahead on the read
        pool. Close the entry when done.
        """
        found = self._walk(key, lambda i, tier: tier.open(key, self._reading, _Hooks(self, i, key)))
        return None if found is None else found[1]

    def _drop(self, tier: Tier, key: str, exc: Exception) -> None:
        """Delete a bad entry from `tier` and count it (another format version: quietly)."""
        stale = isinstance(exc, OldFormatError)
        log.log(logging.DEBUG if stale else logging.WARNING, "store: dropping %s entry %s from %s: %s",
                "old" if stale else "bad", key[:12], tier.name, exc)
        tier.delete(key)
        self._counters.dropped(tier.name, stale)

    def contains(self, key: str) -> bool:
        validate_key(key)
        self._check_open()
        return any(t.contains(key) for t in self.tiers)

    # --- writes ---------------------------------------------------------------------------------

    def put(self, key: str, kv: ChunkKV) -> ChunkKV:
        """Store `kv` in every tier; returns it as a hit will give it back (the codec's round trip,
        in kv's dtype: what a just-computed chunk must be to give the same answer as a stored one)."""
        validate_key(key)
        self._check_open()
        if self.fingerprint is not None and kv.fingerprint != self.fingerprint:
            raise KVMismatchError(f"KV of model {kv.fingerprint!r} offered to the store of {self.fingerprint!r}")
        if kv_key(kv.fingerprint, kv.context_hash, kv.token_ids) != key:
            raise KVMismatchError("key must be kv_key(kv.fingerprint, kv.context_hash, kv.token_ids)")
        entry = Entry.computed(kv, self.codec)
        for tier in self.tiers:
            tier.put(key, entry)
        self._counters.bump("puts")
        return entry.kv

    def _promote(self, key: str, found_at: int, entry: Entry) -> None:
        """Put an entry found in tier `found_at` into the faster tiers (not after close)."""
        if not self._closed:
            for tier in self.tiers[:found_at]:
                tier.put(key, entry)

    def flush(self) -> None:
        """Wait until every tier's background writes have been attempted."""
        for tier in self.tiers:
            tier.flush()

    def delete(self, key: str) -> bool:
        """Delete from every tier; a background write of `key` queued before this never lands."""
        validate_key(key)
        self._check_open()
        return any([t.delete(key) for t in self.tiers])  # a list, so every tier is asked

    # --- upkeep ---------------------------------------------------------------------------------

    def gc(self, keep_fingerprint: str) -> dict[str, dict[str, int]]:
        """Drop entries of other models, or whose header is unreadable, from every tier that keeps its
        own (each tier's `gc`: Redis's is its TTL); report what is left. Reads headers only."""
        self._check_open()
        report = {t.name: done for t in self.tiers if (done := t.gc(keep_fingerprint)) is not None}
        log.info("store: gc kept %s: %s", keep_fingerprint, report)
        return report

    def close(self) -> None:
        """Stop the read pool and close the tiers (each finishes and stops its own background work).
        Idempotent; a second caller waits for the first to finish. Calls already past their
        closed-check complete."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            for tier in self.tiers:
                tier.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- stats ----------------------------------------------------------------------------------

    def counts(self) -> dict[str, dict[str, Any]]:
        """Per tier, this process's lookups: hits, misses, corrupt, stale, load_ms_mean/last, layer_reads,
        layer_bytes, layer_ms_mean. In-memory counters only (no tier is asked): cheap on a hot path."""
        return self._counters.snapshot()[1]

    def stats(self) -> dict[str, Any]:
        """Totals (lookups by get and by open both count; writes queued and dropped by the tiers that
        write behind), plus per tier its `counts()` and the tier's own entries, bytes, evictions, errors
        (None where a tier can't know, e.g. Redis sizes)."""
        totals, counts = self._counters.snapshot()
        tiers = {t.name: t.stats() | counts[t.name] for t in self.tiers}
        writes = {name: sum(s.get(name) or 0 for s in tiers.values()) for name in ("dropped_writes", "write_queue")}
        return {"codec": self.codec, "fingerprint": self.fingerprint, **totals, **writes, "tiers": tiers}


class _Hooks:
    """What an entry opened from tier `index` reports back (store.base.EntryHooks)."""

    def __init__(self, store: TieredStore, index: int, key: str) -> None:
        self._store, self._index, self._key = store, index, key
        self.promotes = index > 0

    def dropped(self, exc: Exception) -> None:
        self._store._drop(self._store.tiers[self._index], self._key, exc)

    def layer_read(self, nbytes: int, seconds: float) -> None:
        self._store._counters.layer_read(self._store.tiers[self._index].name, nbytes, seconds)

    def promote(self, entry: Entry) -> None:
        self._store._promote(self._key, self._index, entry)
