"""Writes done later by their own thread: what keeps encoding and slow tiers off the request path.

Two users: the store's own writer (TieredStore.put_nowait: a chunk's codec round trip, encoding and every tier
write, off the model thread) and a slow shared tier's (Redis: its network writes, off the store's writer).
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from common.threads import serial_torch

log = logging.getLogger("ragblend.store")
Item = TypeVar("Item")


class WriteBehind(Generic[Item]):
    """Does `write(key, item)` in order on one thread (`thread_name`) from a bounded queue.

    A full queue drops the write (counted in `dropped`): a caller never waits. A write that raises is
    logged and counted in `errors`, and the thread goes on. A delete of a key wins over every write of it
    queued before: `forget(key)` leaves a tombstone holding the last write number issued so far, and the
    thread skips (or, when the write was already in flight, undoes with `delete`) any write of that key up
    to it. `close()` does what is queued, then stops; later writes are dropped.
    """

    def __init__(self, write: Callable[[str, Item], Any], delete: Callable[[str], Any], size: int,
                 thread_name: str = "ragblend-store-writer",
                 done: Callable[[str, Item], Any] = lambda key, item: None) -> None:
        """`done(key, item)`: after each queued write, written, skipped (deleted since) or failed."""
        self._write, self._delete, self._done = write, delete, done
        self._queue: queue.Queue[tuple[int, str, Item] | None] = queue.Queue(maxsize=size)
        self._lock = threading.Lock()  # the closed flag, the write numbers, tombstones and the counts
        self._seq = self._done_seq = 0  # last write queued, last write attempted
        self._tombstones: dict[str, int] = {}
        self._closed = False
        self.dropped = self.errors = 0
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    def submit(self, key: str, item: Item) -> bool:
        """Queue a write; False (and counted) if the queue is full or the writer closed."""
        with self._lock:  # closed-check, number and enqueue together: nothing lands after close's sentinel
            if not self._closed:
                try:
                    self._queue.put_nowait((self._seq + 1, key, item))
                except queue.Full:
                    pass
                else:
                    self._seq += 1
                    return True
            self.dropped += 1
        log.debug("store: write queue full or closed, %s not written", key[:12])
        return False

    def forget(self, key: str) -> None:
        """`key` is being deleted: no write of it queued until now may land."""
        with self._lock:
            if self._seq > self._done_seq:  # writes are queued or in flight
                self._tombstones[key] = self._seq

    def _deleted_since(self, key: str, seq: int) -> bool:
        with self._lock:
            return self._tombstones.get(key, 0) >= seq

    def _run(self) -> None:
        serial_torch()  # serially: the model thread's workers keep spinning (common.threads)
        while (job := self._queue.get()) is not None:
            seq, key, item = job
            try:
                if not self._deleted_since(key, seq):
                    self._write(key, item)
                    if self._deleted_since(key, seq):  # a delete ran while the write was in flight
                        self._delete(key)
            except Exception:  # keep the writer alive whatever the tier does
                with self._lock:
                    self.errors += 1
                log.exception("store: background write of %s failed", key[:12])
            finally:
                self._finish(key, item)
                with self._lock:  # every write up to seq is done: older tombstones are spent
                    self._done_seq = seq
                    if self._tombstones:
                        self._tombstones = {k: s for k, s in self._tombstones.items() if s > seq}
                self._queue.task_done()
        self._queue.task_done()

    def _finish(self, key: str, item: Item) -> None:
        try:
            self._done(key, item)
        except Exception:
            log.exception("store: finishing the background write of %s failed", key[:12])

    def pending(self) -> int:
        return self._queue.qsize()

    def flush(self) -> None:
        """Wait until every queued write has been attempted."""
        self._queue.join()

    def close(self) -> None:
        """Do what is queued, then stop the thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True  # from here on nothing is queued: the sentinel is last
        self._queue.put(None)  # may wait for room; the thread drains without our lock
        self._thread.join()
