"""The tier chain: memory -> disk -> Redis, encode once on put, decode once on a hit.

    get:  try each tier in order; the first entry that decodes and passes its checks wins and
          is copied into the faster tiers. An entry that fails (damaged, another model's, not
          the KV its key names) is deleted from that tier, counted as `corrupt`, and the lookup
          goes on as if it were a miss.
    put:  encode once; write memory and disk now, Redis from a background thread through a
          bounded queue (full queue: the write is dropped and counted; a request never waits).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from blend.chunk_kv import ChunkKV, KVMismatchError
from store.disk import DiskTier
from store.keys import kv_key, validate_key
from store.memory import MemoryTier
from store.redis_tier import RedisTier
from store.serialize import CODECS, HEAD_BYTES, CorruptEntryError, decode, encode, read_header
from store.settings import StoreSettings

log = logging.getLogger("ragblend.store")


class Tier(Protocol):
    """A key -> serialized-entry map. Tiers never parse entries; `remote` ones are written in the
    background, `trusted` ones hold bytes that never left this process (digest check skipped)."""

    name: str
    remote: bool
    trusted: bool

    def get(self, key: str) -> bytes | None: ...
    def head(self, key: str, nbytes: int) -> bytes | None: ...  # an entry's first bytes
    def put(self, key: str, data: bytes) -> None: ...
    def delete(self, key: str) -> bool: ...
    def contains(self, key: str) -> bool: ...
    def keys(self) -> Iterator[str]: ...
    def stats(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


class KVStore(Protocol):
    """What the rest of ragblend needs from a KV store."""

    def get(self, key: str) -> ChunkKV | None: ...
    def put(self, key: str, kv: ChunkKV) -> None: ...
    def delete(self, key: str) -> bool: ...
    def contains(self, key: str) -> bool: ...
    def stats(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


@dataclass
class _TierCounts:
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    load_s_total: float = 0.0
    load_s_last: float | None = None

    def as_dict(self) -> dict[str, Any]:
        mean = self.load_s_total / self.hits * 1e3 if self.hits else None
        last = None if self.load_s_last is None else self.load_s_last * 1e3
        return {"hits": self.hits, "misses": self.misses, "corrupt": self.corrupt,
                "load_ms_mean": mean, "load_ms_last": last}


class TieredStore:
    """ChunkKVs by key over a list of tiers, fastest first.

    `fingerprint` set: entries of any other model are refused on put and dropped on get.
    Every entry must sit under its own key, `kv_key(kv.fingerprint, kv.context_hash,
    kv.token_ids)`: put raises KVMismatchError otherwise, and get drops entries that don't.
    """

    def __init__(self, tiers: Sequence[Tier], codec: str = "fp16", fingerprint: str | None = None,
                 queue_size: int = 256) -> None:
        if codec not in CODECS:
            raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}")
        if len({t.name for t in tiers}) != len(tiers):
            raise ValueError(f"tier names must be unique: {[t.name for t in tiers]}")
        self.tiers = list(tiers)
        self.codec, self.fingerprint = codec, fingerprint
        self._lock = threading.Lock()
        self._counts = {t.name: _TierCounts() for t in self.tiers}
        self._totals = dict.fromkeys(("gets", "hits", "misses", "puts", "corrupt", "dropped_writes"), 0)
        self._queue: queue.Queue[tuple[Tier, str, bytes] | None] = queue.Queue(maxsize=queue_size)
        self._closed = False
        self._writer: threading.Thread | None = None
        if any(t.remote for t in self.tiers):
            self._writer = threading.Thread(target=self._write_loop, name="ragblend-store-writer", daemon=True)
            self._writer.start()

    # --- reads ----------------------------------------------------------------------------------

    def get(self, key: str) -> ChunkKV | None:
        return self.get_with_tier(key)[0]

    def get_with_tier(self, key: str) -> tuple[ChunkKV | None, str | None]:
        """The entry and the name of the tier it was found in (None, None on a miss)."""
        validate_key(key)
        self._bump("gets")
        for i, tier in enumerate(self.tiers):
            start = time.perf_counter()
            data = tier.get(key)
            kv = None if data is None else self._decode(tier, key, data)
            self._count(tier, None if kv is None else time.perf_counter() - start)
            if kv is not None:
                log.debug("store: hit %s in %s", key[:12], tier.name)
                self._write(key, data, self.tiers[:i])  # promote
                self._bump("hits")
                return kv, tier.name
        self._bump("misses")
        return None, None

    def _decode(self, tier: Tier, key: str, data: bytes) -> ChunkKV | None:
        try:
            kv = decode(data, self.fingerprint, verify_checksum=not tier.trusted)
            if kv_key(kv.fingerprint, kv.context_hash, kv.token_ids) != key:
                raise KVMismatchError("entry is not the KV its key names")
            return kv
        except (CorruptEntryError, KVMismatchError) as exc:
            log.warning("store: dropping bad entry %s from %s: %s", key[:12], tier.name, exc)
            tier.delete(key)
            with self._lock:
                self._counts[tier.name].corrupt += 1
                self._totals["corrupt"] += 1
            return None

    def contains(self, key: str) -> bool:
        validate_key(key)
        return any(t.contains(key) for t in self.tiers)

    # --- writes ---------------------------------------------------------------------------------

    def put(self, key: str, kv: ChunkKV) -> None:
        validate_key(key)
        if self.fingerprint is not None and kv.fingerprint != self.fingerprint:
            raise KVMismatchError(f"KV of model {kv.fingerprint!r} offered to the store of {self.fingerprint!r}")
        if kv_key(kv.fingerprint, kv.context_hash, kv.token_ids) != key:
            raise KVMismatchError("key must be kv_key(kv.fingerprint, kv.context_hash, kv.token_ids)")
        self._write(key, encode(kv, self.codec), self.tiers)
        self._bump("puts")

    def _write(self, key: str, data: bytes, tiers: Sequence[Tier]) -> None:
        for tier in tiers:
            if not tier.remote:
                tier.put(key, data)
                continue
            try:
                if self._closed:
                    raise queue.Full
                self._queue.put_nowait((tier, key, data))
            except queue.Full:
                self._bump("dropped_writes")
                log.debug("store: write queue full, %s not sent to %s", key[:12], tier.name)

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            tier, key, data = item
            try:
                tier.put(key, data)
            except Exception:  # keep the writer alive whatever a tier does
                log.exception("store: background write to %s failed", tier.name)
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued background write has been attempted."""
        if self._writer is not None:
            self._queue.join()

    def delete(self, key: str) -> bool:
        """Delete from every tier (a queued background write of `key` may still land later)."""
        validate_key(key)
        return any([t.delete(key) for t in self.tiers])  # a list, so every tier is asked

    # --- upkeep ---------------------------------------------------------------------------------

    def gc(self, keep_fingerprint: str) -> dict[str, dict[str, int]]:
        """Drop local entries of other models, or whose header is unreadable; report what is left.

        Reads headers only. Caps are enforced on every put and when a disk tier opens. Redis is
        left alone: replicas share it and may run another model; its TTL ages entries out.
        """
        report = {}
        for tier in (t for t in self.tiers if not t.remote):
            scanned = dropped = 0
            for key in list(tier.keys()):
                head = tier.head(key, HEAD_BYTES)
                if head is None:
                    continue
                scanned += 1
                try:
                    keep = read_header(head)["fingerprint"] == keep_fingerprint
                except CorruptEntryError:
                    keep = False
                if not keep:
                    dropped += tier.delete(key)
            stats = tier.stats()
            report[tier.name] = {"scanned": scanned, "dropped": dropped,
                                 "entries": stats["entries"], "bytes": stats["bytes"]}
        log.info("store: gc kept %s: %s", keep_fingerprint, report)
        return report

    def close(self) -> None:
        """Flush the background writer, stop it, close the tiers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._writer is not None:
            self._queue.put(None)  # after everything queued so far
            self._writer.join()
        for tier in self.tiers:
            tier.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- stats ----------------------------------------------------------------------------------

    def _bump(self, name: str) -> None:
        with self._lock:
            self._totals[name] += 1

    def _count(self, tier: Tier, load_s: float | None) -> None:
        """A hit that took `load_s` seconds (tier get + decode), or a miss (None)."""
        with self._lock:
            c = self._counts[tier.name]
            if load_s is None:
                c.misses += 1
                return
            c.hits += 1
            c.load_s_total += load_s
            c.load_s_last = load_s

    def stats(self) -> dict[str, Any]:
        """Totals, plus per tier: hits, misses, corrupt, load_ms_mean/last and the tier's own
        entries, bytes, evictions, errors (None where a tier can't know, e.g. Redis sizes)."""
        with self._lock:
            totals = dict(self._totals)
            counts = {name: c.as_dict() for name, c in self._counts.items()}
        tiers = {t.name: t.stats() | counts[t.name] for t in self.tiers}
        return {"codec": self.codec, "fingerprint": self.fingerprint, **totals,
                "write_queue": self._queue.qsize(), "tiers": tiers}


def build_store(settings: StoreSettings, kv_dir: Path, fingerprint: str | None) -> TieredStore:
    """The store the app runs: memory, then disk under `kv_dir`, then Redis if a URL is set.

    A tier with a 0-byte cap is left out. `fingerprint` None opens it for inspection only (stats).
    """
    tiers: list[Tier] = []
    if settings.memory_bytes > 0:
        tiers.append(MemoryTier(settings.memory_bytes))
    if settings.disk_bytes > 0:
        tiers.append(DiskTier(kv_dir, settings.disk_bytes))
    if settings.redis_url:
        tiers.append(RedisTier(settings.redis_url, password=settings.redis_password,
                               prefix=settings.redis_prefix, ttl_s=settings.redis_ttl_s,
                               timeout_s=settings.redis_timeout_s, backoff_s=settings.redis_backoff_s))
    return TieredStore(tiers, codec=settings.codec, fingerprint=fingerprint,
                       queue_size=settings.redis_queue_size)
