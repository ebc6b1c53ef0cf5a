"""Local-disk tier: one file per entry, LRU under a byte cap, atomic writes, survives restarts.

Files live at `root/<first 2 hex chars>/<key>.kv`. A write goes to a temp file in the same
directory and is renamed into place, so readers see the old entry or the new one, never half of
one. Recency is tracked in memory and mirrored in file mtimes (a hit refreshes it), so a restart
rebuilds the LRU order from the directory. One process per directory. The tier does not parse
entries: the store decodes them, and deletes any that fail their checks.
"""
from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from store.eviction import LRUPolicy
from store.keys import is_key, validate_key

log = logging.getLogger("ragblend.store")
SUFFIX = ".kv"


class DiskTier:
    name = "disk"
    remote = False
    trusted = False

    def __init__(self, root: str | Path, capacity_bytes: int, fsync: bool = False) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._fsync = fsync
        self._lru = LRUPolicy(capacity_bytes)
        self._lock = threading.Lock()
        self._evictions = self._errors = 0
        self._failing = False
        self._load_index()

    def _path(self, key: str) -> Path:
        validate_key(key)
        return self.root / key[:2] / f"{key}{SUFFIX}"

    def _load_index(self) -> None:
        """Rebuild the LRU from the files, oldest mtime first; drop temp files a crash left."""
        found = []
        for path in self.root.glob("??/*"):
            if path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)
                continue
            key = path.name.removesuffix(SUFFIX)
            if path.name.endswith(SUFFIX) and is_key(key) and path.parent.name == key[:2]:
                st = path.stat()
                found.append((st.st_mtime_ns, key, st.st_size))
        for _, key, size in sorted(found):
            self._admit(key, size)

    def _admit(self, key: str, size: int) -> None:
        """Account for `key` as most recent and delete the files evicted for it (hold the lock)."""
        for old in self._lru.add(key, size):
            self._path(old).unlink(missing_ok=True)
            self._evictions += 1

    def _error(self, action: str, key: str, exc: OSError) -> None:
        self._errors += 1
        # Warn once per failure streak (e.g. a full disk), not once per request.
        log.log(logging.DEBUG if self._failing else logging.WARNING,
                "disk tier: %s %s failed: %s", action, key[:12], exc)
        self._failing = True

    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            with self._lock:
                self._lru.remove(key)
            return None
        except OSError as exc:
            self._error("read", key, exc)
            return None
        with self._lock:
            self._lru.touch(key)
        with contextlib.suppress(OSError):
            os.utime(path)  # persist recency for the next restart
        return data

    def head(self, key: str, nbytes: int) -> bytes | None:
        """The first `nbytes` of an entry, without touching its recency."""
        try:
            with open(self._path(key), "rb") as f:
                return f.read(nbytes)
        except FileNotFoundError:
            return None

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        if not self._lru.fits(len(data)):
            return
        try:
            path.parent.mkdir(exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    if self._fsync:
                        f.flush()
                        os.fsync(f.fileno())
                with self._lock:  # rename and accounting together, so an eviction can't interleave
                    os.replace(tmp, path)
                    self._admit(key, len(data))
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            if self._fsync:
                _fsync_dir(path.parent)
        except OSError as exc:
            self._error("write", key, exc)
            return
        self._failing = False

    def delete(self, key: str) -> bool:
        path = self._path(key)
        with self._lock:
            self._lru.remove(key)
            try:
                path.unlink()
                return True
            except FileNotFoundError:
                return False

    def contains(self, key: str) -> bool:
        return self._path(key).is_file()

    def keys(self) -> Iterator[str]:
        with self._lock:
            return iter(self._lru.keys())

    def close(self) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"entries": len(self._lru), "bytes": self._lru.nbytes, "capacity": self._lru.capacity,
                    "evictions": self._evictions, "errors": self._errors}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
