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
    put:  each tier keeps the chunk in its own codec (`codec`: one for all, or one per tier): tensor tiers
          the KV as that codec gives it back (`Codec.round_trip`), byte tiers its encoding, each made once
          per codec; the caller gets the fastest tier's form back. A promoted entry keeps the form it was
          found in (the bytes of a Redis hit land on disk as they are: no second quantisation).
    put_nowait: the same, done by the store's writer thread (`ragblend-store-put`): the caller (the model
          thread, after a request) only hands the chunk over. Until its write is done the chunk is *pending*:
          a read finds it as a hit in the fastest tier (its codec round trip, made by the first thread that
          needs it, never a half-written entry); a write that fails or is dropped leaves a clean miss. The
          queue is bounded (`write_queue` chunks, `write_queue_bytes`): a full one drops the chunk, counted.
          Which tiers take it is the admission policy's (store/admission.py).
    delete: from every tier and the pending chunks; it wins over any background write of that key queued
          before it.
    lease: entries held against LRU under a family, per tier within its pinned cap (store/leases.py,
          whose docstring is the API the request side uses); a hit in `get` or `open` renews soft leases.
          A store with leases runs one sweeper thread (`ragblend-lease-sweeper`), stopped by close().
    gc:   entries of other models dropped; with `owned`, also entries of this one that no document,
          prompt head or lease owns and that nobody used for `min_idle_s`.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from common.chunk_kv import ChunkKV, KVMismatchError
from common.placement import HOST, Placement
from store.admission import TENSOR_TIERS, Admission
from store.base import Entry, OpenEntry, Reading, Tier
from store.counters import StoreCounters
from store.keys import kv_key, validate_key
from store.layered import ResidentEntry
from store.leases import Freed, LeaseResult, Leases, family_id
from store.serialize import Codec, CorruptEntryError, OldFormatError, get_codec
from store.write_behind import WriteBehind

log = logging.getLogger("ragblend.store")
Found = TypeVar("Found", Entry, OpenEntry)
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
                 write_queue: int = 1024, write_queue_bytes: int = 512 << 20) -> None:
        """`read_threads`: the pool that reads open entries' layers ahead, concurrently (0: each
        layer is read when asked, on the caller's thread); `read_ahead`: layers per entry queued ahead.
        `leases`: the lease book the tiers were built with (their `pinned`); None: a store without leases.
        `codec`: a name or Codec (cachegen's comes as a Codec: it codes with fitted tables) for every tier, or
        one per tier name. `admission`: which tiers take what put_nowait hands over (default: every tier);
        `write_queue` / `write_queue_bytes`: the most chunks / bytes pending at once (past either: dropped)."""
        if len({t.name for t in tiers}) != len(tiers):
            raise ValueError(f"tier names must be unique: {[t.name for t in tiers]}")
        self.tiers = list(tiers)
        self._codecs = {t.name: get_codec(_codec_of(codec, t.name)) for t in self.tiers}
        self.codecs = {name: c.name for name, c in self._codecs.items()}  # tier name -> its codec's name
        self.fingerprint, self.placement = fingerprint, placement
        self._pool = ThreadPoolExecutor(read_threads, thread_name_prefix="ragblend-store-read") \
            if read_threads else None
        self._readings = {name: Reading(c, fingerprint, placement, self._pool, read_ahead)
                          for name, c in self._codecs.items()}
        self._counters = StoreCounters(t.name for t in self.tiers)
        self._close_lock = threading.Lock()
        self._closed = False
        self._leases = leases
        self.admission = admission or Admission()
        self._pending: dict[str, _Write] = {}  # key -> its put_nowait write not yet done
        self._pending_bytes, self._pending_cap = 0, write_queue_bytes
        self._pending_lock = threading.Lock()
        self._writer: WriteBehind[_Write] = WriteBehind(self._write, self._delete_in_tiers, write_queue,
                                                        thread_name="ragblend-store-put", done=self._unpend)
        self._stop_sweeper = threading.Event()
        self._sweeper = None
        if leases is not None:
            self._sweeper = threading.Thread(target=self._sweep_loop, name="ragblend-lease-sweeper", daemon=True)
            self._sweeper.start()

    @property
    def codec(self) -> str:
        """The fastest tier's codec: how `put` hands a chunk back."""
        return self.codecs[self.tiers[0].name] if self.tiers else "native"

    def _check_open(self) -> None:
        if self._closed:  # a plain read: once True it stays True
            raise StoreClosedError("the KV store is closed")

    # --- reads ----------------------------------------------------------------------------------

    def _walk(self, key: str, read: Callable[[int, Tier], Found | None], pending: Callable[[Entry], Found],
              only: str | None = None) -> tuple[int, Found] | None:
        """The first tier's hit, `read(index, tier)`, with that tier's index; None on a miss everywhere.
        A chunk still pending is a hit in the fastest tier, `pending(entry)`. A bad entry is dropped and the
        walk goes on. `only`: that tier alone."""
        validate_key(key)
        self._check_open()
        if only is not None and only not in self.codecs:
            raise ValueError(f"no tier {only!r}: the store has {list(self.codecs)}")
        self._counters.bump("gets")
        if self.tiers and only in (None, self.tiers[0].name) and (write := self._pending_write(key)) is not None:
            start = time.perf_counter()
            found = pending(write.entry(self._codecs[self.tiers[0].name]))
            self._counters.looked_up(self.tiers[0].name, time.perf_counter() - start)
            self._counters.bump("hits")
            self._counters.bump("pending_hits")
            self.admission.sight(key)  # a second sight before the write runs: it asks when it runs
            return 0, found
        for i, tier in enumerate(self.tiers):
            if only is not None and tier.name != only:
                continue
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
                if self._leases is not None:
                    self._leases.hit(key)  # its soft leases run again
                if self.admission.sight(key) == 2 and tier.name in TENSOR_TIERS:
                    self._write_down(key, i)  # second sight: the tiers below may take it now
                return i, found
        self._counters.bump("misses")
        return None

    def get(self, key: str) -> ChunkKV | None:
        return self.get_with_tier(key)[0]

    def get_with_tier(self, key: str) -> tuple[ChunkKV | None, str | None]:
        """The entry and the name of the tier it was found in (None, None on a miss)."""
        found = self._walk(key, lambda i, tier: tier.get(key, self._readings[tier.name]), lambda entry: entry)
        if found is None:
            return None, None
        index, entry = found
        self._promote(key, index, entry)
        return entry.kv, self.tiers[index].name

    def open(self, key: str, tier: str | None = None) -> OpenEntry | None:
        """The entry under `key` opened for per-layer reads (a blend.pipeline.LayerSource), or None on a miss.

        From a tensor tier: its tensors, layer by layer. From a byte tier: reads and checks only the
        head (header, token ids, model, key); `entry.layer(i)` reads the rest, ahead on the read
        pool. Close the entry when done. `tier`: from that tier alone (the loading controller's choice).
        """
        found = self._walk(key, lambda i, t: t.open(key, self._readings[t.name], _Hooks(self, i, key)),
                           lambda entry: ResidentEntry(key, self.tiers[0].name, self.codecs[self.tiers[0].name],
                                                       entry.kv, _Hooks(self, 0, key)),
                           only=tier)
        return None if found is None else found[1]

    def _drop(self, tier: Tier, key: str, exc: Exception) -> None:
        """Delete a bad entry from `tier` and count it (another format version: quietly)."""
        stale = isinstance(exc, OldFormatError)
        log.log(logging.DEBUG if stale else logging.WARNING, "store: dropping %s entry %s from %s: %s",
                "old" if stale else "bad", key[:12], tier.name, exc)
        tier.delete(key)
        self._counters.dropped(tier.name, stale)

    def contains(self, key: str, tier: str | None = None) -> bool:
        """Whether any tier (or `tier`) holds `key`, without reading it."""
        validate_key(key)
        self._check_open()
        if tier is None and self._pending_write(key) is not None:
            return True
        return any(t.contains(key) for t in self.tiers if tier is None or t.name == tier)

    # --- writes ---------------------------------------------------------------------------------

    def put(self, key: str, kv: ChunkKV) -> ChunkKV:
        """Store `kv` in every tier, each in its codec; returns it as a hit in the fastest tier will give it
        back (that codec's round trip, in kv's dtype: what a just-computed chunk must be to give the same
        answer as a stored one)."""
        self._check_put(key, kv)
        self.admission.sight(key)
        write = _Write(lambda codec: Entry.computed(kv, codec))  # each form made once, whichever tier asks
        for tier in self.tiers:
            tier.put(key, write.entry(self._codecs[tier.name]))
        self._counters.bump("puts")
        return write.entry(self._codecs[self.tiers[0].name]).kv if self.tiers else kv

    def put_nowait(self, key: str, kv: ChunkKV) -> bool:
        """Hand `kv` to the store's writer thread, which stores it as `put` does in the tiers the admission
        policy admits; returns at once: True if queued, False if dropped (the queue is full or the store
        closing; counted in `dropped_puts`). `kv` must be the caller's own copy, never changed after (a span
        cut from a prefill's cache). Until written, reads find it pending (the module docstring)."""
        self._check_put(key, kv)
        self.admission.sight(key)
        write = _Write(lambda codec: Entry.computed(kv, codec), nbytes=kv.nbytes)
        with self._pending_lock:
            room = self._pending_bytes + write.nbytes <= self._pending_cap
            if room:
                self._pending_bytes += write.nbytes
                replaced = self._pending.get(key)
                self._pending[key] = write
        if room and self._writer.submit(key, write):
            self._counters.bump("queued_puts")
            return True
        if room:
            self._unpend(key, write, restore=replaced)
        self._counters.bump("dropped_puts")
        log.debug("store: put queue full, %s not stored", key[:12])
        return False

    def _check_put(self, key: str, kv: ChunkKV) -> None:
        validate_key(key)
        self._check_open()
        if self.fingerprint is not None and kv.fingerprint != self.fingerprint:
            raise KVMismatchError(f"KV of model {kv.fingerprint!r} offered to the store of {self.fingerprint!r}")
        if kv_key(kv.fingerprint, kv.context_hash, kv.token_ids) != key:
            raise KVMismatchError("key must be kv_key(kv.fingerprint, kv.context_hash, kv.token_ids)")

    def _pending_write(self, key: str) -> _Write | None:
        with self._pending_lock:
            return self._pending.get(key)

    def _unpend(self, key: str, write: _Write, restore: _Write | None = None) -> None:
        """`write` is done, skipped or dropped: reads go to the tiers again (to `restore`, a write of the same
        key still queued, if given)."""
        with self._pending_lock:
            self._pending_bytes -= write.nbytes
            if self._pending.get(key) is write:
                if restore is not None:
                    self._pending[key] = restore
                else:
                    del self._pending[key]

    def _write(self, key: str, write: _Write) -> None:
        """On the writer thread: `write` into the tiers from `write.start` on that admit it (a write-down:
        those that lack it)."""
        start = time.perf_counter()
        try:
            for tier in self.tiers[write.start:]:
                if not self.admission.admitted(key, tier.name, self._leased(key), fastest=tier is self.tiers[0],
                                               victims=lambda tier=tier: self._victims(tier, write)):
                    continue
                if write.start and tier.contains(key):
                    continue
                if (entry := write.entry(self._codecs[tier.name])) is None:
                    return  # a write-down of an entry evicted meanwhile: nothing to write
                tier.put(key, entry)
            self._counters.bump("write_downs" if write.start else "puts")
        finally:
            self._counters.add_write_s(time.perf_counter() - start)

    def _victims(self, tier: Tier, write: _Write) -> list[str] | None:
        """What `write` would evict in `tier` now (its entry is made once: the put that follows takes the same)."""
        entry = write.entry(self._codecs[tier.name])
        return None if entry is None else tier.victims(tier.footprint(entry))

    def _write_down(self, key: str, found_at: int) -> None:
        """Queue the entry a tensor tier holds (hit there) for the tiers below it, which admission may have
        kept it out of so far (not pending: the tiers below need no read of it until the writer asks)."""
        below = found_at + 1
        if self.closed or not self.admission.filters or below >= len(self.tiers):
            return
        tier, reading = self.tiers[found_at], self._readings[self.tiers[found_at].name]

        def entry(codec: Codec) -> Entry | None:
            held = tier.get(key, reading)  # the tensors, as they are there now (None: evicted since)
            return None if held is None else Entry.of_tensors(held.kv, codec)
        self._writer.submit(key, _Write(entry, start=below))

    def _leased(self, key: str) -> bool:
        return self._leases is not None and any(self._leases.holds(t.name, key) for t in self.tiers)

    def _delete_in_tiers(self, key: str) -> bool:
        return any([t.delete(key) for t in self.tiers])  # a list, so every tier is asked

    @property
    def closed(self) -> bool:
        return self._closed

    def _promote(self, key: str, found_at: int, entry: Entry) -> None:
        """Put an entry found in tier `found_at` into the faster tiers (not after close)."""
        if not self._closed:
            for tier in self.tiers[:found_at]:
                tier.put(key, entry)

    def flush(self) -> None:
        """Wait until every put_nowait and every tier's background writes have been attempted."""
        self._writer.flush()
        for tier in self.tiers:
            tier.flush()

    def delete(self, key: str) -> bool:
        """Delete from every tier and the pending chunks; a background write of `key` queued before this never
        lands."""
        validate_key(key)
        self._check_open()
        self._writer.forget(key)
        with self._pending_lock:
            was_pending = self._pending.pop(key, None) is not None  # its bytes are given back when it is done
        return self._delete_in_tiers(key) or was_pending

    # --- leases (store/leases.py) ----------------------------------------------------------------

    def lease(self, keys: Iterable[str], family: str, ttl_s: float, soft: bool = True, tenant: str = "",
              share: float = 1.0) -> LeaseResult:
        """Hold the entries under `keys` for `family` (free text, hashed) for `ttl_s` seconds in every tier
        whose pinned cap allows; see store/leases.py. Reads no entry that every tier already holds."""
        leases = self._lease_book()
        if not ttl_s > 0:
            raise ValueError(f"a lease's ttl_s must be > 0, got {ttl_s}")
        family = family_id(family, tenant)
        keys = list(dict.fromkeys(keys))
        if any(self._pending_write(key) is not None for key in keys):
            self._writer.flush()  # a request's spans may still be on their way to the tiers (off the model thread)
        sizes: dict[str, dict[str, int]] = {}
        missing: list[str] = []
        for key in keys:
            found = self._sizes(validate_key(key), leases)
            if found is None:
                missing.append(key)
            else:
                sizes[key] = found
        if not sizes:
            return LeaseResult(family, (), tuple(missing), (), {}, None, leases.pinned_bytes())
        try:
            result = leases.grant(family, sizes, missing, ttl_s, soft, share)
        except Exception as exc:  # the database is down: the request still answers, unleased
            log.warning("store: lease not granted: %s: %s", type(exc).__name__, exc)
            why = f"the lease ledger failed ({type(exc).__name__})"
            return LeaseResult(family, (), tuple(missing), (), dict.fromkeys(leases.caps, why), None,
                               leases.pinned_bytes())
        for tier in self.tiers:
            if tier.name in result.tiers:
                tier.on_lease(result.leased, held=True)
        for key in result.leased if self.admission.filters else ():
            self._write_down_leased(key)
        return result

    def _write_down_leased(self, key: str) -> None:
        """A leased key is admitted everywhere: queue the tensors a tier holds for the tiers below (a pending
        write of it needs nothing: it asks about leases when it runs)."""
        if self._pending_write(key) is None:
            found_at = next((i for i, t in enumerate(self.tiers) if t.name in TENSOR_TIERS and t.contains(key)), None)
            if found_at is not None:
                self._write_down(key, found_at)

    def _sizes(self, key: str, leases: Leases) -> dict[str, int] | None:
        """The bytes the entry takes (or would take) in each tier with a pinned cap; None if no tier holds
        it. The entry is read only when some tier lacks it (e.g. a Redis write still queued)."""
        tiers = [t for t in self.tiers if t.name in leases.caps]
        sizes = {t.name: t.size_of(key) for t in tiers}
        if all(n is None for n in sizes.values()) and self._pending_write(key) is None:
            return None
        if any(n is None for n in sizes.values()):
            entry = self._any_entry(key)
            if entry is None:
                return None
            sizes = {t.name: t.footprint(entry) if sizes[t.name] is None else sizes[t.name] for t in tiers}
        return sizes

    def _any_entry(self, key: str) -> Entry | None:
        """The entry pending, or from the first tier that holds a good one (no promotion, no lookup counted)."""
        if self.tiers and (write := self._pending_write(key)) is not None:
            return write.entry(self._codecs[self.tiers[0].name])
        for tier in self.tiers:
            try:
                entry = tier.get(key, self._readings[tier.name])
            except (CorruptEntryError, KVMismatchError) as exc:
                self._drop(tier, key, exc)
                continue
            if entry is not None:
                return entry
        return None

    def release(self, family: str, tenant: str = "") -> int:
        """End the family's leases now; the number of entries they held (they stay, under LRU)."""
        freed = self._lease_book().release(family_id(family, tenant))
        self._unpinned(freed)
        return len({key for key, _, _ in freed})

    def drop_family(self, family: str, keep: Callable[[list[str]], Collection[str]] = lambda keys: (),
                    tenant: str = "") -> tuple[int, int]:
        """End the family's leases and delete their entries from every tier, except those another family
        still leases or `keep(keys)` names (entries owned elsewhere: documents' passages). Returns (entries
        the leases held, entries deleted)."""
        leases = self._lease_book()
        freed = leases.release(family_id(family, tenant))
        self._unpinned(freed)
        keys = sorted({key for key, _, _ in freed})
        if not keys:
            return 0, 0
        kept = set(keep(keys)) | leases.leased_keys()
        return len(keys), sum(self.delete(key) for key in keys if key not in kept)

    def lease_stats(self, family: str | None = None, limit: int = 100, tenant: str | None = None) -> dict[str, Any]:
        """Leases, families, entries, pinned bytes and caps per tier, refusals and expiries, and by family (the
        `limit` pinning the most, or `family` alone), of `tenant`'s families (None: all): Leases.stats."""
        return self._lease_book().stats(family_id(family, tenant or "") if family else None, limit, tenant)

    def sweep_leases(self) -> None:
        """One sweeper pass now: renewals written, ended leases deleted (Redis TTLs given back), the
        snapshot read again. The sweeper thread runs it every `refresh_s`."""
        self._unpinned(self._lease_book().sweep())

    def _lease_book(self) -> Leases:
        self._check_open()
        if self._leases is None:
            raise RuntimeError("this store keeps no leases (built without a lease ledger)")
        return self._leases

    def _unpinned(self, freed: list[Freed]) -> None:
        """Tell each tier which keys the last lease there let go."""
        for tier in self.tiers:
            if keys := [key for key, name, still in freed if name == tier.name and not still]:
                tier.on_lease(keys, held=False)

    def _sweep_loop(self) -> None:
        failing = False
        while not self._stop_sweeper.wait(self._leases.refresh_s):
            try:
                self.sweep_leases()
            except StoreClosedError:
                return
            except Exception as exc:  # the database is down: the snapshot stands until it is back
                log.log(logging.DEBUG if failing else logging.WARNING, "store: lease sweep failed: %s: %s",
                        type(exc).__name__, exc)
                failing = True
            else:
                failing = False

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
        """Stop the lease sweeper (renewals not yet written are written), write what put_nowait queued, stop
        the read pool, and close the tiers (each finishes and stops its own background work). Idempotent; a
        second caller waits for the first to finish. Calls already past their closed-check complete."""
        with self._close_lock:
            if self._closed:
                return
            self._writer.close()  # drains: every chunk handed over is written (or failed) first
            if self._sweeper is not None:
                self._stop_sweeper.set()
                self._sweeper.join()
                try:
                    self.sweep_leases()
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
        write behind), plus per tier its `counts()` and the tier's own entries, bytes, evictions, errors
        (None where a tier can't know, e.g. Redis sizes)."""
        totals, counts = self._counters.snapshot()
        tiers = {t.name: t.stats() | counts[t.name] for t in self.tiers}
        writes = {name: sum(s.get(name) or 0 for s in tiers.values()) for name in ("dropped_writes", "write_queue")}
        leases = {} if self._leases is None else {"leases": self._leases.stats(limit=0)}
        with self._pending_lock:
            pending = {"pending": len(self._pending), "pending_bytes": self._pending_bytes}
        behind = {"put_queue": self._writer.pending(), "put_errors": self._writer.errors, **pending,
                  "admission": self.admission.policy}
        return {"codecs": self.codecs, "fingerprint": self.fingerprint, **totals, **writes, **behind, "tiers": tiers,
                **leases, "decode": self.decode_counts()}


class _Write:
    """One write for the store's writer: the chunk's entry in each codec, made once by whichever thread asks
    first (a read of it pending, or the writer), into the tiers from `start` on (0: a put; more: a write-down).
    `nbytes`: what it holds pending (0: nothing, a write-down's tensors stay in their tier)."""

    def __init__(self, make: Callable[[Codec], Entry | None], start: int = 0, nbytes: int = 0) -> None:
        self._make, self.start, self.nbytes = make, start, nbytes
        self._entries: dict[str, Entry | None] = {}
        self._lock = threading.Lock()

    def entry(self, codec: Codec) -> Entry | None:
        """The chunk's entry in `codec` (a put's always exists; a write-down's is None once evicted)."""
        with self._lock:
            if codec.name not in self._entries:
                self._entries[codec.name] = self._make(codec)
            return self._entries[codec.name]


def _codec_of(codec: str | Codec | Mapping[str, str | Codec], tier: str) -> str | Codec:
    if not isinstance(codec, Mapping):
        return codec
    if tier not in codec:
        raise ValueError(f"no codec for tier {tier!r}: codecs are given for {sorted(codec)}")
    return codec[tier]


class _Hooks:
    """What an entry opened from tier `index` reports back (store.base.EntryHooks)."""

    def __init__(self, store: TieredStore, index: int, key: str) -> None:
        self._store, self._index, self._key = store, index, key
        self.promotes = index > 0

    def dropped(self, exc: Exception) -> None:
        self._store._drop(self._store.tiers[self._index], self._key, exc)

    def layer_read(self, nbytes: int, seconds: float) -> None:
        self._store._counters.layer_read(self._store.tiers[self._index].name, nbytes, seconds)

    def layer_decoded(self, codec: str, nbytes: int, tokens: int, seconds: float) -> None:
        self._store._counters.layer_decoded(codec, nbytes, tokens, seconds)

    def promote(self, entry: Entry) -> None:
        self._store._promote(self._key, self._index, entry)


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
