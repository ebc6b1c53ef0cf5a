"""The tier chain: gpu -> memory -> disk -> Redis; encode once on put, decode once on a hit.

Two kinds of tier: tensor tiers (gpu, memory: `holds_tensors`) hold each chunk's KV as tensors in
the model's dtype, a hit is the tensors themselves; byte tiers (disk, Redis) hold the serialized
entry, checked and decoded on the way out.

    get:  try each tier in order; the first entry that decodes and passes its checks wins and
          is copied into the faster tiers (tensor tiers get the decoded KV, byte tiers the bytes). An entry that fails (damaged, another model's, not
          the KV its key names) is deleted from that tier, counted as `corrupt`, and the lookup
          goes on as if it were a miss. Entries of another format version are dropped the same
          way but counted as `stale` (an upgrade, not damage).
    open: the same lookup reading only the head; layers are then read one by one (LayeredEntry).
    put:  tensor tiers get the KV as the codec will give it back (`Codec.round_trip`, returned to
          the caller); byte tiers the entry, encoded once: write disk now, Redis from a background thread through a
          bounded queue (full queue: the write is dropped and counted; a request never waits).
    delete: wins over any background write of that key queued before it.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from common.chunk_kv import ChunkKV, KVMismatchError
from store.disk import DiskTier
from store.keys import kv_key, validate_key
from store.layered import LayeredEntry, RangeReader, ResidentEntry
from store.memory import MemoryTier
from store.redis_tier import RedisTier
from store.serialize import (HEAD_BYTES, OPEN_BYTES, CorruptEntryError, OldFormatError, decode, encode, get_codec,
                             head_nbytes, parse_head, read_header)
from store.settings import StoreSettings

log = logging.getLogger("ragblend.store")


class Tier(Protocol):
    """A key -> serialized-entry map (a byte tier). Tiers never parse entries; `remote` ones are
    written in the background, `trusted` ones hold bytes that never left this process (digest
    check skipped). A tensor tier (store.memory.MemoryTier, `holds_tensors = True`) has the same
    methods on ChunkKVs instead of bytes, and no reader or head."""

    name: str
    remote: bool
    trusted: bool

    def get(self, key: str) -> bytes | None: ...
    def reader(self, key: str) -> RangeReader | None: ...  # byte-range reads of one entry
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
    def open(self, key: str, *, pin_memory: bool = False) -> LayeredEntry | ResidentEntry | None: ...
    def put(self, key: str, kv: ChunkKV) -> ChunkKV: ...
    def delete(self, key: str) -> bool: ...
    def contains(self, key: str) -> bool: ...
    def stats(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


class StoreClosedError(RuntimeError):
    """The store was used after close()."""


@dataclass
class _TierCounts:
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    stale: int = 0
    load_s_total: float = 0.0
    load_s_last: float | None = None
    layer_reads: int = 0
    layer_bytes: int = 0
    layer_s_total: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        mean = self.load_s_total / self.hits * 1e3 if self.hits else None
        last = None if self.load_s_last is None else self.load_s_last * 1e3
        layer_mean = self.layer_s_total / self.layer_reads * 1e3 if self.layer_reads else None
        return {"hits": self.hits, "misses": self.misses, "corrupt": self.corrupt, "stale": self.stale,
                "load_ms_mean": mean, "load_ms_last": last, "layer_reads": self.layer_reads,
                "layer_bytes": self.layer_bytes, "layer_ms_mean": layer_mean}


class TieredStore:
    """ChunkKVs by key over a list of tiers, fastest first.

    `fingerprint` set: entries of any other model are refused on put and dropped on get.
    Every entry must sit under its own key, `kv_key(kv.fingerprint, kv.context_hash,
    kv.token_ids)`: put raises KVMismatchError otherwise, and get drops entries that don't.
    Thread-safe. After close(), every call but close/flush/stats raises StoreClosedError.
    """

    def __init__(self, tiers: Sequence[Tier], codec: str = "fp16", fingerprint: str | None = None,
                 queue_size: int = 256, read_threads: int = 4, read_ahead: int = 2) -> None:
        """`read_threads`: the pool that reads open entries' layers ahead, concurrently (0: each
        layer is read when asked, on the caller's thread); `read_ahead`: layers per entry queued ahead."""
        self._codec = get_codec(codec)
        if len({t.name for t in tiers}) != len(tiers):
            raise ValueError(f"tier names must be unique: {[t.name for t in tiers]}")
        self.tiers = list(tiers)
        self.codec, self.fingerprint = codec, fingerprint
        self.read_ahead = read_ahead
        self._pool = ThreadPoolExecutor(read_threads, thread_name_prefix="ragblend-store-read") if read_threads else None
        self._lock = threading.Lock()  # counters, the closed flag, the write sequence and tombstones
        self._close_lock = threading.Lock()
        self._counts = {t.name: _TierCounts() for t in self.tiers}
        self._totals = dict.fromkeys(("gets", "hits", "misses", "puts", "corrupt", "stale", "dropped_writes"), 0)
        # Background writes are (seq, tier, key, data); a delete leaves a tombstone holding the last
        # seq issued before it, and the writer skips (or undoes) any write of that key up to it.
        self._queue: queue.Queue[tuple[int, Tier, str, bytes] | None] = queue.Queue(maxsize=queue_size)
        self._seq = self._done_seq = 0  # last write queued, last write attempted
        self._tombstones: dict[str, int] = {}
        self._closed = False
        self._writer: threading.Thread | None = None
        if any(t.remote for t in self.tiers):
            self._writer = threading.Thread(target=self._write_loop, name="ragblend-store-writer", daemon=True)
            self._writer.start()

    def _check_open(self) -> None:
        if self._closed:  # a plain read: once True it stays True
            raise StoreClosedError("the KV store is closed")

    # --- reads ----------------------------------------------------------------------------------

    def get(self, key: str) -> ChunkKV | None:
        return self.get_with_tier(key)[0]

    def get_with_tier(self, key: str) -> tuple[ChunkKV | None, str | None]:
        """The entry and the name of the tier it was found in (None, None on a miss)."""
        validate_key(key)
        self._check_open()
        self._bump("gets")
        for i, tier in enumerate(self.tiers):
            start = time.perf_counter()
            if _holds_tensors(tier):
                kv, data = tier.get(key), None
            else:
                data = tier.get(key)
                kv = None if data is None else self._decode(tier, key, data)
            self._count(tier, None if kv is None else time.perf_counter() - start)
            if kv is not None:
                log.debug("store: hit %s in %s", key[:12], tier.name)
                self._promote(key, i, kv, data)
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
            self._drop(tier, key, exc)
            return None

    def open(self, key: str, *, pin_memory: bool = False) -> LayeredEntry | ResidentEntry | None:
        """The entry under `key` opened for per-layer reads (a blend.pipeline.LayerSource), or None on a miss.

        From a tensor tier: its tensors, layer by layer. From a byte tier: reads and checks only the
        head (header, token ids, model, key); `entry.layer(i)` reads the rest, ahead on the read
        pool. `pin_memory`: byte-tier layers are staged in page-locked memory when CUDA is
        available (ignored otherwise). Close the entry when done.
        """
        validate_key(key)
        self._check_open()
        self._bump("gets")
        for i, tier in enumerate(self.tiers):
            start = time.perf_counter()
            if _holds_tensors(tier):
                kv = tier.get(key)
                self._count(tier, None if kv is None else time.perf_counter() - start)
                if kv is not None:
                    self._bump("hits")
                    return ResidentEntry(key, tier.name, self.codec, kv, _Hooks(self, i, key))
                continue
            reader = tier.reader(key)
            opened = None if reader is None else self._open_head(tier, key, reader)
            self._count(tier, None if opened is None else time.perf_counter() - start)
            if opened is not None:
                self._bump("hits")
                head, head_bytes = opened
                return LayeredEntry(key, tier.name, head, head_bytes, reader, _Hooks(self, i, key),
                                    verify=not tier.trusted, pin_memory=pin_memory, pool=self._pool,
                                    ahead=self.read_ahead)
            if reader is not None:
                reader.close()
        self._bump("misses")
        return None

    def _open_head(self, tier: Tier, key: str, reader: RangeReader) -> tuple | None:
        """(EntryHead, the head's bytes) of an opened entry, or None (dropped if bad)."""
        try:
            data, want = b"", OPEN_BYTES
            while len(data) < want:  # a second read only for a head longer than the first
                data = bytes(reader.read(0, want))
                if len(data) < want:
                    break  # the whole entry is shorter: parse_head says what is missing
                want = max(want, head_nbytes(data))
            head = parse_head(data, self.fingerprint, verify_checksum=not tier.trusted)
            if kv_key(head.header["fingerprint"], head.header["context_hash"], head.token_ids) != key:
                raise KVMismatchError("entry is not the KV its key names")
            return head, data[:head.head_nbytes]
        except OSError as exc:
            log.debug("store: reading %s from %s failed: %s", key[:12], tier.name, exc)
            return None
        except (CorruptEntryError, KVMismatchError) as exc:
            self._drop(tier, key, exc)
            return None

    def _drop(self, tier: Tier, key: str, exc: Exception) -> None:
        """Delete a bad entry from `tier` and count it (another format version: quietly)."""
        stale = isinstance(exc, OldFormatError)
        log.log(logging.DEBUG if stale else logging.WARNING, "store: dropping %s entry %s from %s: %s",
                "old" if stale else "bad", key[:12], tier.name, exc)
        tier.delete(key)
        with self._lock:
            counts = self._counts[tier.name]
            if stale:
                counts.stale += 1
                self._totals["stale"] += 1
            else:
                counts.corrupt += 1
                self._totals["corrupt"] += 1

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
        stored = self.as_stored(kv)
        data = encode(kv, self.codec) if any(not _holds_tensors(t) for t in self.tiers) else None
        self._write(key, stored, data, self.tiers)
        self._bump("puts")
        return stored

    def as_stored(self, kv: ChunkKV) -> ChunkKV:
        """`kv` as a hit will read it back: fresh tensors, kv's dtype and device."""
        return self._codec.round_trip(kv)

    def _promote(self, key: str, found_at: int, kv: ChunkKV | None, data: bytes | None) -> None:
        """Copy an entry found in tier `found_at` into the faster tiers (not after close)."""
        if found_at > 0 and not self._closed:
            self._write(key, kv, data, self.tiers[:found_at])

    def _write(self, key: str, kv: ChunkKV | None, data: bytes | None, tiers: Sequence[Tier]) -> None:
        """Write `kv` into tensor tiers and `data` into byte tiers (each made from the other if missing)."""
        for tier in tiers:
            if _holds_tensors(tier):
                if kv is None:
                    kv = decode(data, verify_checksum=False)
                tier.put(key, kv)
                continue
            if data is None:
                data = encode(kv, self.codec)
            if not tier.remote:
                tier.put(key, data)
                continue
            with self._lock:  # closed-check, seq and enqueue together: nothing lands after close's sentinel
                queued = self._enqueue(tier, key, data)
                if not queued:
                    self._totals["dropped_writes"] += 1
            if not queued:
                log.debug("store: write queue full or store closed, %s not sent to %s", key[:12], tier.name)

    def _enqueue(self, tier: Tier, key: str, data: bytes) -> bool:
        """Queue a background write, numbered; False if the queue is full or the store closed.
        Hold the lock."""
        if self._closed:
            return False
        try:
            self._queue.put_nowait((self._seq + 1, tier, key, data))
        except queue.Full:
            return False
        self._seq += 1
        return True

    def _deleted_since(self, key: str, seq: int) -> bool:
        with self._lock:
            return self._tombstones.get(key, 0) >= seq

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            seq, tier, key, data = item
            try:
                if not self._deleted_since(key, seq):
                    tier.put(key, data)
                    if self._deleted_since(key, seq):  # a delete ran while the write was in flight
                        tier.delete(key)
            except Exception:  # keep the writer alive whatever a tier does
                log.exception("store: background write to %s failed", tier.name)
            finally:
                with self._lock:  # every write up to seq is done: older tombstones are spent
                    self._done_seq = seq
                    if self._tombstones:
                        self._tombstones = {k: s for k, s in self._tombstones.items() if s > seq}
                self._queue.task_done()
        self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued background write has been attempted."""
        if self._writer is not None:
            self._queue.join()

    def delete(self, key: str) -> bool:
        """Delete from every tier; a background write of `key` queued before this never lands."""
        validate_key(key)
        self._check_open()
        if self._writer is not None:
            with self._lock:
                if self._seq > self._done_seq:  # writes are queued or in flight
                    self._tombstones[key] = self._seq
        return any([t.delete(key) for t in self.tiers])  # a list, so every tier is asked

    # --- upkeep ---------------------------------------------------------------------------------

    def gc(self, keep_fingerprint: str) -> dict[str, dict[str, int]]:
        """Drop local entries of other models, or whose header is unreadable; report what is left.

        Reads headers only. Caps are enforced on every put and when a disk tier opens. Redis is
        left alone: replicas share it and may run another model; its TTL ages entries out.
        """
        self._check_open()
        report = {}
        for tier in (t for t in self.tiers if not t.remote):
            scanned = dropped = 0
            for key in list(tier.keys()):
                head = tier.get(key) if _holds_tensors(tier) else tier.head(key, HEAD_BYTES)
                if head is None:
                    continue
                scanned += 1
                try:
                    fingerprint = head.fingerprint if _holds_tensors(tier) else read_header(head)["fingerprint"]
                    keep = fingerprint == keep_fingerprint
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
        """Flush the background writer, stop it, close the tiers. Idempotent; a second caller
        waits for the first to finish. Calls already past their closed-check complete."""
        with self._close_lock:
            with self._lock:
                if self._closed:
                    return
                self._closed = True  # from here on nothing is enqueued: the sentinel is last
            if self._writer is not None:
                self._queue.put(None)  # may wait for room; the writer drains without our locks
                self._writer.join()
            if self._pool is not None:
                self._pool.shutdown(wait=True)
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
        """A hit that took `load_s` seconds (tier read + decode, or head read + check for open),
        or a miss (None)."""
        with self._lock:
            c = self._counts[tier.name]
            if load_s is None:
                c.misses += 1
                return
            c.hits += 1
            c.load_s_total += load_s
            c.load_s_last = load_s

    def _count_layer(self, tier: Tier, nbytes: int, seconds: float) -> None:
        """One layer read through a LayeredEntry (read + check + decode): bandwidth for a loader."""
        with self._lock:
            c = self._counts[tier.name]
            c.layer_reads += 1
            c.layer_bytes += nbytes
            c.layer_s_total += seconds

    def counts(self) -> dict[str, dict[str, Any]]:
        """Per tier, this process's lookups: hits, misses, corrupt, stale, load_ms_mean/last, layer_reads,
        layer_bytes, layer_ms_mean. In-memory counters only (no tier is asked): cheap on a hot path."""
        with self._lock:
            return self._count_dicts()

    def _count_dicts(self) -> dict[str, dict[str, Any]]:
        # under _lock
        return {name: c.as_dict() for name, c in self._counts.items()}

    def stats(self) -> dict[str, Any]:
        """Totals, plus per tier its `counts()` and the tier's own entries, bytes, evictions, errors
        (None where a tier can't know, e.g. Redis sizes). Lookups by get and by open both count."""
        with self._lock:  # totals and counts from one moment
            totals, counts = dict(self._totals), self._count_dicts()
        tiers = {t.name: t.stats() | counts[t.name] for t in self.tiers}
        return {"codec": self.codec, "fingerprint": self.fingerprint, **totals,
                "write_queue": self._queue.qsize(), "tiers": tiers}


def _holds_tensors(tier: Tier) -> bool:
    return getattr(tier, "holds_tensors", False)


class _Hooks:
    """What an open entry of tier `index` reports back (store.layered.EntryHooks)."""

    def __init__(self, store: TieredStore, index: int, key: str) -> None:
        self._store, self._index, self._key = store, index, key
        self._tier = store.tiers[index]
        faster = store.tiers[:index]
        self.wants_bytes = any(not _holds_tensors(t) for t in faster)
        self.wants_tensors = any(_holds_tensors(t) for t in faster)

    def dropped(self, exc: Exception) -> None:
        self._store._drop(self._tier, self._key, exc)

    def layer_read(self, nbytes: int, seconds: float) -> None:
        self._store._count_layer(self._tier, nbytes, seconds)

    def promote(self, kv: ChunkKV | None, data: bytes | None) -> None:
        self._store._promote(self._key, self._index, kv, data)


GPU_SHARE = 0.2  # gpu_bytes "auto": this share of the device's free memory once the model is loaded


def gpu_bytes(setting: int | str, device: torch.device | str | None) -> int:
    """The gpu tier's cap: `setting` itself, or for "auto" GPU_SHARE of `device`'s free memory
    (0 off CUDA). An explicit cap off CUDA is 0 too: there is no device memory to hold it in."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type != "cuda":
        return 0
    if setting == "auto":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * GPU_SHARE)
    return int(setting)


def build_store(settings: StoreSettings, kv_dir: Path, fingerprint: str | None,
                device: torch.device | str | None = None) -> TieredStore:
    """The store the app runs for a model on `device`: a gpu tier (CUDA only), memory (pinned on
    CUDA), then disk under `kv_dir`, then Redis if a URL is set.

    A tier with a 0-byte cap is left out. `fingerprint` None opens it for inspection only (stats).
    """
    on_cuda = device is not None and torch.device(device).type == "cuda"
    tiers: list[Tier] = []
    if (gpu := gpu_bytes(settings.gpu_bytes, device)) > 0:
        tiers.append(MemoryTier(gpu, device=device, name="gpu"))
    if settings.memory_bytes > 0:
        tiers.append(MemoryTier(settings.memory_bytes, pin_memory=on_cuda))
    if settings.disk_bytes > 0:
        tiers.append(DiskTier(kv_dir, settings.disk_bytes))
    if settings.redis_url:
        tiers.append(RedisTier(settings.redis_url, password=settings.redis_password,
                               prefix=settings.redis_prefix, ttl_s=settings.redis_ttl_s,
                               timeout_s=settings.redis_timeout_s, backoff_s=settings.redis_backoff_s))
    return TieredStore(tiers, codec=settings.codec, fingerprint=fingerprint,
                       queue_size=settings.redis_queue_size, read_threads=settings.read_threads)
