"""The tier chain: gpu -> memory -> disk -> Redis behind one interface, `TieredStore`, cut by job as LMCache v1 cuts
its storage backends:

    store/lookup.py   the walk every lookup takes (get, open, contains) and promotion of hits
    store/writer.py   puts: `put`, `put_nowait` and its pending chunks, the bounded write queue (`room`),
                      admission (store/admission.py), write-downs
    store/leasing.py  leases (lease, release, drop_family, stats) and the sweep, which the process's housekeeping
                      thread runs every `refresh_s` (common/housekeeping.py; a store given none starts its own)
    here              the interface, delete, gc, close and stats.

Every tier is a store.base.Tier and every entry a store.base.Entry, so the store never asks which form a tier keeps
(the memory and gpu tiers keep tensors, disk and Redis the encoded entry); each tier keeps its own codec (`codec`:
one for all, or one per tier).

    delete: from every tier and the pending chunks; it wins over any background write of that key queued before it.
    gc:     entries of other models dropped; with `owned`, also entries of this one that no document, prompt head or
            lease owns and that nobody used for `min_idle_s`.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from common.chunk_kv import ChunkKV, KVMismatchError
from common.housekeeping import Housekeeping
from common.placement import HOST, Placement
from common.threads import serial_torch
from store.admission import Admission
from store.base import OpenEntry, Reading, Tier
from store.counters import StoreCounters
from store.keys import kv_key, validate_key
from store.leases import LeaseResult, Leases
from store.leasing import Leasing
from store.lookup import Lookup
from store.serialize import Codec, CorruptEntryError, get_codec
from store.writer import Writer

log = logging.getLogger("ragblend.store")
# gc's rule for live work: an entry read or written this recently is kept, owned or not. Longer than any
# upload's precompute runs before its commit makes the chunks own their entries, and than a conversation
# pause worth keeping; an entry removed anyway is only recomputed when next needed.
GC_MIN_IDLE_S = 3600.0


class KVStore(Protocol):
    """What the rest of ragblend needs from a KV store."""

    def get(self, key: str) -> ChunkKV | None: ...
    def open(self, key: str, tier: str | None = None) -> OpenEntry | None: ...
    def put(self, key: str, kv: ChunkKV) -> ChunkKV: ...
    def put_nowait(self, key: str, kv: ChunkKV) -> bool: ...
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

    def __init__(self, tiers: Sequence[Tier], codec: str | Codec | Mapping[str, str | Codec] = "fp16",
                 fingerprint: str | None = None,
                 placement: Placement = HOST, read_threads: int = 4, read_ahead: int = 2,
                 leases: Leases | None = None, admission: Admission | None = None,
                 write_queue: int = 4096, write_queue_bytes: int = 3 << 29,
                 housekeeping: Housekeeping | None = None) -> None:
        """`read_threads`: the pool that reads open entries' layers ahead, concurrently (0: each
        layer is read when asked, on the caller's thread); `read_ahead`: layers per entry queued ahead.
        `leases`: the lease book the tiers were built with (their `pinned`); None: a store without leases.
        `codec`: a name or Codec (cachegen's comes as a Codec: it codes with fitted tables) for every tier, or
        one per tier name. `admission`: which tiers take what put_nowait hands over (default: every tier);
        `write_queue` / `write_queue_bytes`: the most chunks / bytes pending at once (past either: refused).
        `housekeeping`: the thread that sweeps the leases (None: the store starts its own when it has leases)."""
        if len({t.name for t in tiers}) != len(tiers):
            raise ValueError(f"tier names must be unique: {[t.name for t in tiers]}")
        self.tiers = list(tiers)
        codecs = {t.name: get_codec(_codec_of(codec, t.name)) for t in self.tiers}
        self.codecs = {name: c.name for name, c in codecs.items()}  # tier name -> its codec's name
        self.fingerprint, self.placement = fingerprint, placement
        self._pool = ThreadPoolExecutor(read_threads, thread_name_prefix="ragblend-store-read",
                                        initializer=serial_torch) \
            if read_threads else None
        readings = {name: Reading(c, fingerprint, placement, self._pool, read_ahead) for name, c in codecs.items()}
        self._counters = StoreCounters(t.name for t in self.tiers)
        self._close_lock = threading.Lock()
        self._closed = False
        self._leases = leases
        self.admission = admission or Admission()
        self.writer = Writer(self.tiers, codecs, readings, self._counters, self.admission,
                             leased=lambda key: self.leasing is not None and self.leasing.holds(key),
                             write_queue=write_queue, write_queue_bytes=write_queue_bytes)
        self.lookup = Lookup(self.tiers, self.codecs, readings, self._counters, self.admission, self.writer, leases,
                             closed=lambda: self._closed)
        self.leasing = None if leases is None else Leasing(leases, self.tiers, self.writer, self.lookup,
                                                           self.admission)
        self._own_housekeeping = housekeeping is None and leases is not None
        self._housekeeping = Housekeeping() if self._own_housekeeping else housekeeping
        self._sweep = None if leases is None else \
            self._housekeeping.every(leases.refresh_s, self.leasing.sweep_quietly, "store: lease sweep")

    @property
    def codec(self) -> str:
        """The fastest tier's codec: how `put` hands a chunk back."""
        return self.codecs[self.tiers[0].name] if self.tiers else "native"

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:  # a plain read: once True it stays True
            raise StoreClosedError("the KV store is closed")

    def _checked(self, key: str) -> str:
        validate_key(key)
        self._check_open()
        return key

    # --- reads (store/lookup.py) ------------------------------------------------------------------

    def get(self, key: str) -> ChunkKV | None:
        return self.get_with_tier(key)[0]

    def get_with_tier(self, key: str) -> tuple[ChunkKV | None, str | None]:
        """The entry and the name of the tier it was found in (None, None on a miss)."""
        return self.lookup.get_with_tier(self._checked(key))

    def open(self, key: str, tier: str | None = None) -> OpenEntry | None:
        """The entry under `key` opened for per-layer reads (a blend.pipeline.LayerSource), or None on a miss.

        From a tensor tier: its tensors, layer by layer. From a byte tier: reads and checks only the
        head (header, token ids, model, key); `entry.layer(i)` reads the rest, ahead on the read
        pool. Close the entry when done. `tier`: from that tier alone (the loading controller's choice).
        """
        return self.lookup.open(self._checked(key), tier)

    def contains(self, key: str, tier: str | None = None) -> bool:
        """Whether any tier (or `tier`) holds `key`, without reading it."""
        return self.lookup.contains(self._checked(key), tier)

    # --- writes (store/writer.py) -----------------------------------------------------------------

    def put(self, key: str, kv: ChunkKV) -> ChunkKV:
        """Store `kv` in every tier, each in its codec; returns it as a hit in the fastest tier will give it
        back (that codec's round trip, in kv's dtype: what a just-computed chunk must be to give the same
        answer as a stored one)."""
        self._check_put(key, kv)
        return self.writer.put(key, kv)

    def put_nowait(self, key: str, kv: ChunkKV) -> bool:
        """Hand `kv` to the store's writer thread, which stores it as `put` does in the tiers the admission
        policy admits; returns at once: True if queued, False if refused (the queue has no room, or the store is
        closing; counted in `dropped_puts`). `kv` must be the caller's own copy, never changed after (a span
        cut from a prefill's cache). Until written, reads find it pending (store/writer.py)."""
        self._check_put(key, kv)
        return self.writer.put_nowait(key, kv)

    def put_room(self) -> tuple[int, int]:
        """(chunks, bytes) put_nowait takes now before it refuses."""
        return self.writer.room()

    def _check_put(self, key: str, kv: ChunkKV) -> None:
        self._checked(key)
        if self.fingerprint is not None and kv.fingerprint != self.fingerprint:
            raise KVMismatchError(f"KV of model {kv.fingerprint!r} offered to the store of {self.fingerprint!r}")
        if kv_key(kv.fingerprint, kv.context_hash, kv.token_ids) != key:
            raise KVMismatchError("key must be kv_key(kv.fingerprint, kv.context_hash, kv.token_ids)")

    def flush(self) -> None:
        """Wait until every put_nowait and every tier's background writes have been attempted."""
        self.writer.flush()
        for tier in self.tiers:
            tier.flush()

    def delete(self, key: str) -> bool:
        """Delete from every tier and the pending chunks; a background write of `key` queued before this never
        lands."""
        return self.writer.delete(self._checked(key))

    # --- leases (store/leasing.py, store/leases.py) -----------------------------------------------

    def lease(self, keys: Iterable[str], family: str, ttl_s: float, soft: bool = True,
              tenant: str = "") -> LeaseResult:
        """Hold the entries under `keys` for `family` of `tenant` (free text, hashed) for `ttl_s` seconds in every
        tier whose pinned cap and the other tenants' reservations allow; see store/leases.py. Reads no entry that
        every tier already holds."""
        keys = list(keys)
        leasing = self._leasing()
        for key in keys:
            validate_key(key)
        return leasing.lease(keys, family, ttl_s, soft, tenant)

    def release(self, family: str, tenant: str = "") -> int:
        """End the family's leases now; the number of entries they held (they stay, under LRU)."""
        return self._leasing().release(family, tenant)

    def drop_family(self, family: str, keep: Callable[[list[str]], Collection[str]] = lambda keys: (),
                    tenant: str = "") -> tuple[int, int]:
        """End the family's leases and delete their entries from every tier, except those another family
        still leases or `keep(keys)` names (entries owned elsewhere: documents' passages). Returns (entries
        the leases held, entries deleted)."""
        return self._leasing().drop_family(family, keep, tenant, self.delete)

    def lease_stats(self, family: str | None = None, limit: int = 100, tenant: str | None = None) -> dict[str, Any]:
        """Leases, families, entries, pinned bytes and caps per tier, refusals and expiries, and by family (the
        `limit` pinning the most, or `family` alone), of `tenant`'s families (None: all): Leases.stats."""
        return self._leasing().stats(family, limit, tenant)

    def sweep_leases(self) -> None:
        """One sweeper pass now: renewals written, ended leases deleted (Redis TTLs given back), the
        snapshot read again. Housekeeping runs it every `refresh_s`."""
        self._leasing().sweep()

    def _leasing(self) -> Leasing:
        self._check_open()
        if self.leasing is None:
            raise RuntimeError("this store keeps no leases (built without a lease ledger)")
        return self.leasing

    # --- upkeep ---------------------------------------------------------------------------------

    def gc(self, keep_fingerprint: str, owned: Callable[[list[str]], Collection[str]] | None = None,
           min_idle_s: float = GC_MIN_IDLE_S) -> dict[str, dict[str, Any]]:
        """Drop entries of other models, or whose header is unreadable, from every tier that keeps its
        own (each tier's `gc`: Redis's is its TTL); report what is left. Reads headers only.

        With `owned(keys)` (the keys among these that documents or the prompt head use), also remove this
        model's entries that nothing owns - no document, prompt head or running lease - from every tier,
        Redis included, unless read or written within `min_idle_s` (GC_MIN_IDLE_S: what a running server
        is about to use) or of an age the tier cannot tell; per tier `orphans`: removed and kept, by why."""
        self._check_open()
        report: dict[str, dict[str, Any]] = {t.name: done for t in self.tiers
                                             if (done := t.gc(keep_fingerprint)) is not None}
        if owned is not None:
            leased: set[str] = set()
            if self._leases is not None:
                self._leases.refresh()  # the leases granted up to now, by any process
                leased = self._leases.leased_keys()
            for tier in self.tiers:
                report.setdefault(tier.name, {})["orphans"] = _orphans(tier, keep_fingerprint, owned, leased,
                                                                       min_idle_s)
        log.info("store: gc kept %s: %s", keep_fingerprint, report)
        return report

    def close(self) -> None:
        """Stop the lease sweep (renewals not yet written are written), write what put_nowait queued, stop
        the read pool, and close the tiers (each finishes and stops its own background work). Idempotent; a
        second caller waits for the first to finish. Calls already past their closed-check complete."""
        with self._close_lock:
            if self._closed:
                return
            self.writer.close()  # drains: every chunk handed over is written (or failed) first
            if self._sweep is not None:
                self._sweep.cancel()
                if self._own_housekeeping:
                    self._housekeeping.close()
                try:
                    self.leasing.sweep()
                except Exception as exc:
                    log.warning("store: last lease sweep failed: %s: %s", type(exc).__name__, exc)
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
        layer_bytes, layer_ms_mean (a layer's read and check, its decode apart). In-memory counters only (no
        tier is asked): cheap on a hot path."""
        return self._counters.snapshot()[1]

    def decode_counts(self) -> dict[str, dict[str, Any]]:
        """Per codec, the layers this process decoded from byte tiers: layers, bytes (as stored), token_layers,
        decode_ms_mean, decode_s_total (the host part and the dequantising on the model's device)."""
        return self._counters.codec_snapshot()

    def stats(self) -> dict[str, Any]:
        """Totals (lookups by get and by open both count; writes queued and dropped by the tiers that
        write behind), the writer's queue and refusals (Writer.stats), plus per tier its `counts()` and the
        tier's own entries, bytes, evictions, errors (None where a tier can't know, e.g. Redis sizes)."""
        totals, counts = self._counters.snapshot()
        tiers = {t.name: t.stats() | counts[t.name] for t in self.tiers}
        writes = {name: sum(s.get(name) or 0 for s in tiers.values()) for name in ("dropped_writes", "write_queue")}
        leases = {} if self._leases is None else {"leases": self._leases.stats(limit=0)}
        return {"codecs": self.codecs, "fingerprint": self.fingerprint, **totals, **writes, **self.writer.stats(),
                "tiers": tiers, **leases, "decode": self.decode_counts()}


def _codec_of(codec: str | Codec | Mapping[str, str | Codec], tier: str) -> str | Codec:
    if not isinstance(codec, Mapping):
        return codec
    if tier not in codec:
        raise ValueError(f"no codec for tier {tier!r}: codecs are given for {sorted(codec)}")
    return codec[tier]


def _orphans(tier: Tier, fingerprint: str, owned: Callable[[list[str]], Collection[str]], leased: set[str],
             min_idle_s: float) -> dict[str, int]:
    """Remove from `tier` the entries of model `fingerprint` nothing owns and nobody used for `min_idle_s`;
    how many were removed, and kept by why."""
    keys = list(tier.keys())
    owned_keys = set(owned(keys)) if keys else set()
    report = dict.fromkeys(("removed", "removed_bytes", "kept_owned", "kept_leased", "kept_recent",
                            "kept_other_model"), 0)
    for key in keys:
        why = _kept_because(tier, key, fingerprint, owned_keys, leased, min_idle_s)
        if why is not None:
            report[why] += 1
            continue
        nbytes = tier.size_of(key) or 0
        if tier.delete(key):
            report["removed"] += 1
            report["removed_bytes"] += nbytes
    return report


def _kept_because(tier: Tier, key: str, fingerprint: str, owned: Collection[str], leased: Collection[str],
                  min_idle_s: float) -> str | None:
    if key in owned:
        return "kept_owned"
    if key in leased:
        return "kept_leased"
    idle = tier.idle_s(key)
    if idle is None or idle < min_idle_s:
        return "kept_recent"  # in use lately, or of an age this tier cannot tell
    try:
        if tier.fingerprint_of(key) not in (fingerprint, None):
            return "kept_other_model"  # a shared Redis may hold another deployment's entries
    except CorruptEntryError:
        pass  # unreadable: nobody's
    return None
