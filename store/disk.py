"""Local-disk tier on diskcache: LRU under a byte cap, safe with several processes on one directory.

diskcache keeps an SQLite index (`cache.db`, WAL) next to one file per entry. Every process that
opens the directory shares that index, so recency, the byte total, the entry count and the
eviction count are the same for all of them (`ragblend ingest` while the server runs): SQLite's
write lock serializes puts, evictions and recency updates across processes.

- Atomic: an entry's file is written in full under a fresh random name before the index points
  at it, and never changed after; a replaced or evicted file is unlinked after the index commits.
  A reader that found an entry reads all of it (an open handle survives the unlink).
- Survives restarts: the index is on disk. Files a crash left behind (written, never indexed)
  are swept when a tier opens, once they are old enough not to be another process's write in
  progress; so are the `??/<key>.kv` files of the format-1 tier this one replaced.
- Exact cap: diskcache's own cull drops ten entries at a time and counts the SQLite file against
  the cap; `_LRUCache._cull` evicts least recently used entries until the entries' bytes fit,
  passing over the keys leases hold here (`pinned`: this process's view of the shared leases).
- Values are bytes only: `_BytesDisk` refuses diskcache's pickle modes both ways.

The tier moves bytes; store.byte_tier.ByteTier (its base) checks and decodes them on the way out.
"""
from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import diskcache

from store.byte_tier import ByteTier
from store.eviction import Pinned, never_pinned
from store.keys import is_key, validate_key
from store.layered import pread_into

log = logging.getLogger("ragblend.store")
ORPHAN_AGE_S = 600.0  # an unindexed file younger than this may be another process's put in progress
_ERRORS = (OSError, sqlite3.Error, diskcache.Timeout)


class _Unreadable(Exception):
    """An indexed value that cannot be read: its file vanished, or it is not plain bytes in a file.

    Not an OSError, which diskcache would swallow as a miss and leave the row in the index. It
    is raised inside get()'s write transaction, where no other diskcache process can be halfway
    through removing the entry, so the row is safe to delete.
    """


class _BytesDisk(diskcache.Disk):
    """diskcache's serializer, restricted to str keys and bytes values stored as files: no pickle."""

    def put(self, key: Any) -> tuple[Any, bool]:
        if type(key) is not str:
            raise TypeError("disk tier keys are str")
        return super().put(key)

    def get(self, key: Any, raw: bool) -> Any:
        if not raw:
            raise _Unreadable("pickled key in the disk tier's index")
        return super().get(key, raw)

    def store(self, value: Any, read: bool, key: Any = diskcache.core.UNKNOWN) -> tuple:
        if type(value) is not bytes:
            raise TypeError("disk tier values are bytes")
        return super().store(value, read, key)  # min_file_size=0: always a file, MODE_BINARY

    def _write(self, full_path: str, iterator: Any, mode: str, encoding: str | None = None) -> int:
        """diskcache's file write; a write that fails (a full disk) leaves no partial file behind."""
        try:
            return super()._write(full_path, iterator, mode, encoding)
        except FileExistsError:  # another put's file (mode "x"): not ours to remove
            raise
        except BaseException:
            Path(full_path).unlink(missing_ok=True)
            raise

    def fetch(self, mode: int, filename: str, value: Any, read: bool) -> Any:
        if mode != diskcache.core.MODE_BINARY:
            raise _Unreadable(f"value of mode {mode}; only files of bytes are read")
        try:
            return super().fetch(mode, filename, value, read)
        except FileNotFoundError:
            raise _Unreadable(f"file {filename} is missing") from None


class _LRUCache(diskcache.Cache):
    """diskcache.Cache with an exact LRU cull that passes over leased keys, and shared eviction counts.

    The SQL below reads diskcache 5.6's schema (pinned in requirements.txt): the Cache table's
    key, size, access_time and filename columns and the Settings row "size".
    """

    pinned: Pinned = staticmethod(never_pinned)

    def _init_ragblend(self) -> None:
        with self.transact():
            self._sql("CREATE TABLE IF NOT EXISTS Ragblend (key TEXT PRIMARY KEY, value INTEGER NOT NULL)")
            self._sql("INSERT OR IGNORE INTO Ragblend VALUES ('evictions', 0)")
            self._sql("INSERT OR IGNORE INTO Ragblend VALUES ('lease_held', 0)")

    def _cull(self, now: float, sql: Any, cleanup: Any, limit: int | None = None) -> None:
        """Runs inside set()'s transaction: evict least recently used entries until the bytes fit, passing
        over leased ones (the rows skipped so far are the OFFSET: evicted rows leave the order)."""
        ((total,),) = sql("SELECT value FROM Settings WHERE key = 'size'").fetchall()
        evicted = held = 0
        while total > self.size_limit:
            rows = sql("SELECT rowid, key, size, filename FROM Cache ORDER BY access_time LIMIT 16 OFFSET ?",
                       (held,)).fetchall()
            if not rows:
                break
            for rowid, key, size, filename in rows:
                if total <= self.size_limit:
                    break
                if self.pinned(key):
                    held += 1
                    continue
                sql("DELETE FROM Cache WHERE rowid = ?", (rowid,))
                cleanup(filename)  # unlinked after the commit
                total -= size
                evicted += 1
        if evicted or held:
            sql("UPDATE Ragblend SET value = value + CASE key WHEN 'evictions' THEN ? ELSE ? END"
                " WHERE key IN ('evictions', 'lease_held')", (evicted, held))

    def fit(self) -> None:
        """Evict until the cap holds (after opening with a lower cap than the entries fill)."""
        with self._transact() as (sql, cleanup):
            self._cull(time.time(), sql, cleanup)

    def victims(self, nbytes: int) -> list[str] | None:
        """The keys `_cull` would evict for a new entry of `nbytes` now ([]: it fits; None: it cannot)."""
        if nbytes > self.size_limit:
            return None
        ((total,),) = self._sql("SELECT value FROM Settings WHERE key = 'size'").fetchall()
        excess, victims = total + nbytes - self.size_limit, []
        if excess > 0:
            for key, size in self._sql("SELECT key, size FROM Cache ORDER BY access_time"):
                if not self.pinned(key):
                    victims.append(key)
                    excess -= size
                    if excess <= 0:
                        break
        return victims if excess <= 0 else None

    def counts(self) -> tuple[int, int, int, int]:
        """(entries, bytes, evictions, evictions passed over a leased entry), as every process on the
        directory sees them."""
        ((entries, nbytes, evictions, held),) = self._sql(
            "SELECT (SELECT value FROM Settings WHERE key = 'count'),"
            " (SELECT value FROM Settings WHERE key = 'size'),"
            " (SELECT value FROM Ragblend WHERE key = 'evictions'),"
            " (SELECT value FROM Ragblend WHERE key = 'lease_held')").fetchall()
        return entries, nbytes, evictions, held

    def size_and_access(self, key: str) -> tuple[int, float] | None:
        """(bytes, last access in unix seconds) of `key`'s entry, without touching it."""
        rows = self._sql("SELECT size, access_time FROM Cache WHERE key = ? AND raw = 1", (key,)).fetchall()
        return rows[0] if rows else None

    def peek_file(self, key: str) -> str | None:
        """Path of `key`'s file, without touching its recency or the hit counts."""
        rows = self._sql("SELECT filename FROM Cache WHERE key = ? AND raw = 1 AND mode = ?",
                         (key, diskcache.core.MODE_BINARY)).fetchall()
        return os.path.join(self.directory, rows[0][0]) if rows else None

    def indexed_files(self) -> set[str]:
        return {row[0] for row in self._sql("SELECT filename FROM Cache WHERE filename IS NOT NULL")}


class FileReader:
    """Byte ranges of one disk entry through the handle diskcache opened; thread-safe (pread)."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    def read(self, offset: int, length: int) -> bytes:
        return os.pread(self._handle.fileno(), length, offset)

    def read_into(self, offset: int, buffer) -> int:
        """Fill `buffer` in place (no intermediate bytes); the number of bytes read."""
        return pread_into(self._handle.fileno(), offset, buffer)

    def close(self) -> None:
        self._handle.close()


class DiskTier(ByteTier):
    name = "disk"

    def __init__(self, root: str | Path, capacity_bytes: int, timeout_s: float = 10.0,
                 pinned: Pinned = never_pinned) -> None:
        """`timeout_s`: how long a call waits for another process's write lock before it counts
        an error and reports a miss (puts and recency updates are sub-millisecond transactions).
        `pinned`: the keys leases hold here, passed over by the cull (from the first one, on opening)."""
        super().__init__()
        if capacity_bytes < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity_bytes}")
        self.root = Path(root)
        self.capacity = capacity_bytes
        self._cache = _LRUCache(str(self.root), timeout=timeout_s, disk=_BytesDisk, size_limit=capacity_bytes,
                                eviction_policy="least-recently-used", disk_min_file_size=0,
                                statistics=False)
        self._cache.pinned = pinned
        self._cache._init_ragblend()
        self._cache.fit()
        self._lock = threading.Lock()
        self._errors = 0
        self._failing = False
        self._sweep()

    def _sweep(self) -> None:
        """Delete files no index row points at: a crashed put's, and format-1 entries and temps."""
        legacy = [p for p in self.root.glob("??/*") if p.suffix in (".kv", ".tmp") and p.is_file()]
        indexed = self._cache.indexed_files()
        cutoff = time.time() - ORPHAN_AGE_S
        orphans = [p for p in self.root.glob("??/??/*.val")
                   if str(p.relative_to(self.root)) not in indexed and p.stat().st_mtime < cutoff]
        for path in legacy + orphans:
            path.unlink(missing_ok=True)
        if legacy or orphans:
            log.info("disk tier: removed %d format-1 files and %d orphaned files from %s",
                     len(legacy), len(orphans), self.root)

    def _error(self, action: str, key: str, exc: Exception) -> None:
        with self._lock:
            self._errors += 1
            failing, self._failing = self._failing, True
        # Warn once per failure streak (e.g. a full disk), not once per request.
        log.log(logging.DEBUG if failing else logging.WARNING, "disk tier: %s %s failed: %s",
                action, key[:12], exc)

    def _ok(self) -> None:
        if self._failing:
            with self._lock:
                self._failing = False

    def _fetch(self, key: str, read: bool) -> Any:
        """diskcache's get; a hit refreshes the entry's recency for every process."""
        validate_key(key)
        try:
            value = self._cache.get(key, read=read)
        except _Unreadable as exc:
            self._error("read", key, exc)
            self.remove(key)  # the index must not count an entry nobody can read
            return None
        except _ERRORS as exc:
            self._error("read", key, exc)
            return None
        self._ok()
        return value

    def get_bytes(self, key: str) -> bytes | None:
        return self._fetch(key, read=False)

    def reader(self, key: str) -> FileReader | None:
        handle = self._fetch(key, read=True)
        return None if handle is None else FileReader(handle)

    def head(self, key: str, nbytes: int) -> bytes | None:
        validate_key(key)
        try:
            path = self._cache.peek_file(key)
            if path is None:
                return None
            with open(path, "rb") as f:
                return f.read(nbytes)
        except FileNotFoundError:  # evicted between the lookup and the open
            return None
        except _ERRORS as exc:
            self._error("read", key, exc)
            return None

    def put_bytes(self, key: str, data: bytes) -> None:
        validate_key(key)
        if len(data) > self.capacity:
            return
        try:
            self._cache.set(key, bytes(data))
        except _ERRORS as exc:
            self._error("write", key, exc)
            return
        self._ok()

    def remove(self, key: str) -> bool:
        validate_key(key)
        try:
            return self._cache.delete(key)
        except _ERRORS as exc:
            self._error("delete", key, exc)
            return False

    def contains(self, key: str) -> bool:
        validate_key(key)
        try:
            return key in self._cache
        except _ERRORS as exc:
            self._error("read", key, exc)
            return False

    def size_of(self, key: str) -> int | None:
        found = self._row(key)
        return None if found is None else found[0]

    def victims(self, nbytes: int) -> list[str] | None:
        try:
            return self._cache.victims(nbytes)
        except _ERRORS as exc:
            self._error("read", "-", exc)
            return None

    def idle_s(self, key: str) -> float | None:
        found = self._row(key)
        return None if found is None else max(0.0, time.time() - found[1])

    def _row(self, key: str) -> tuple[int, float] | None:
        validate_key(key)
        try:
            return self._cache.size_and_access(key)
        except _ERRORS as exc:
            self._error("read", key, exc)
            return None

    def keys(self) -> Iterator[str]:
        try:
            keys = [k for k in self._cache.iterkeys() if is_key(k)]
        except (_Unreadable, *_ERRORS) as exc:
            self._error("list", "-", exc)
            keys = []
        return iter(keys)

    def close(self) -> None:
        super().close()
        self._cache.close()

    def stats(self) -> dict[str, Any]:
        """Entries, bytes, evictions and evictions a lease held off are the directory's (shared by every
        process on it); errors are this process's."""
        try:
            entries, nbytes, evictions, held = self._cache.counts()
        except _ERRORS as exc:
            self._error("stats", "-", exc)
            entries = nbytes = evictions = held = None
        with self._lock:
            errors = self._errors
        return {"entries": entries, "bytes": nbytes, "capacity": self.capacity, "evictions": evictions,
                "lease_held": held, "errors": errors}
