"""The store's writer: puts, the chunks requests hand over (`put_nowait`) and their pending state, admission, and
write-downs, all behind TieredStore.

    put:        each tier keeps the chunk in its own codec: tensor tiers the KV as that codec gives it back
                (`Codec.round_trip`), byte tiers its encoding, each made once per codec; the caller gets the fastest
                tier's form back. Explicit puts are admitted everywhere.
    put_nowait: the same, done by the writer thread (`ragblend-store-put`): the caller (the model thread, after a
                request) only hands the chunk over. Until its write is done the chunk is *pending*: a read finds it
                as a hit in the fastest tier (its codec round trip, made by the first thread that needs it, never a
                half-written entry); a write that fails or is dropped leaves a clean miss. Which tiers take it is
                the admission policy's (store/admission.py).
    room:       the queue is bounded in chunks (`write_queue`) and bytes (`write_queue_bytes`): what is free now is
                `room()`, and a put_nowait past either bound is refused (False, counted by why in
                `dropped_puts_by`), never waited for. The planner reads the refusal and hands over no more of
                that prompt, so what is stored is a clean prefix (app/engine/planner.py).
    write-down: an entry hit a second time in a tensor tier is queued for the byte tiers below that admission kept
                it out of.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from common.chunk_kv import ChunkKV
from store.admission import Admission
from store.base import Entry, Reading, Tier
from store.counters import StoreCounters
from store.serialize import Codec
from store.write_behind import WriteBehind

log = logging.getLogger("ragblend.store")
WRITER_THREAD = "ragblend-store-put"


class Write:
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


class Writer:
    """Puts into `tiers` (fastest first), each in its codec, at once or on the writer thread; thread-safe."""

    def __init__(self, tiers: Sequence[Tier], codecs: dict[str, Codec], readings: dict[str, Reading],
                 counters: StoreCounters, admission: Admission, leased: Callable[[str], bool],
                 write_queue: int = 4096, write_queue_bytes: int = 3 << 29) -> None:
        """`leased(key)`: whether a lease holds the key somewhere (admitted everywhere then)."""
        self.tiers, self._codecs, self._readings = list(tiers), codecs, readings
        self._counters, self.admission, self._leased = counters, admission, leased
        self._pending: dict[str, Write] = {}  # key -> its put_nowait write not yet done
        self._pending_bytes, self.queue_bytes, self.queue_entries = 0, write_queue_bytes, write_queue
        self._dropped = {"entries": 0, "bytes": 0, "closed": 0}  # put_nowait refusals, by the bound that refused
        self._dropped_bytes = 0
        self._lock = threading.Lock()
        self._closed = False
        self._behind: WriteBehind[Write] = WriteBehind(self._write, self.delete_in_tiers, write_queue,
                                                       thread_name=WRITER_THREAD, done=self._unpend)

    def _fastest_codec(self) -> Codec:
        return self._codecs[self.tiers[0].name]

    # --- puts -----------------------------------------------------------------------------------

    def put(self, key: str, kv: ChunkKV) -> ChunkKV:
        """Store `kv` in every tier now; returns it as a hit in the fastest tier gives it back."""
        self.admission.sight(key)
        write = Write(lambda codec: Entry.computed(kv, codec))  # each form made once, whichever tier asks
        for tier in self.tiers:
            tier.put(key, write.entry(self._codecs[tier.name]))
        self._counters.bump("puts")
        return write.entry(self._fastest_codec()).kv if self.tiers else kv

    def put_nowait(self, key: str, kv: ChunkKV) -> bool:
        """Hand `kv` to the writer thread; True if queued, False if refused (no room: see the module doc)."""
        self.admission.sight(key)
        write = Write(lambda codec: Entry.computed(kv, codec), nbytes=kv.nbytes)
        with self._lock:
            why = "closed" if self._closed else "bytes" if self._pending_bytes + write.nbytes > self.queue_bytes \
                else "entries" if self._behind.pending() >= self.queue_entries else None
            if why is None:
                self._pending_bytes += write.nbytes
                replaced = self._pending.get(key)
                self._pending[key] = write
        if why is None and self._behind.submit(key, write):
            self._counters.bump("queued_puts")
            return True
        if why is None:  # the queue filled meanwhile, or closed
            self._unpend(key, write, restore=replaced)
            why = "closed" if self._closed else "entries"
        with self._lock:
            self._dropped[why] += 1
            self._dropped_bytes += write.nbytes
        self._counters.bump("dropped_puts")
        log.debug("store: put queue has no room (%s), %s not stored", why, key[:12])
        return False

    def room(self) -> tuple[int, int]:
        """(chunks, bytes) the queue takes now before it refuses."""
        with self._lock:
            return max(0, self.queue_entries - self._behind.pending()), max(0, self.queue_bytes - self._pending_bytes)

    def pending(self, key: str) -> Write | None:
        with self._lock:
            return self._pending.get(key)

    def pending_entry(self, key: str) -> Entry | None:
        """The entry of `key` pending, as the fastest tier will hold it; None if none is pending."""
        write = self.pending(key) if self.tiers else None
        return None if write is None else write.entry(self._fastest_codec())

    def _unpend(self, key: str, write: Write, restore: Write | None = None) -> None:
        """`write` is done, skipped or dropped: reads go to the tiers again (to `restore`, a write of the same
        key still queued, if given)."""
        with self._lock:
            self._pending_bytes -= write.nbytes
            if self._pending.get(key) is write:
                if restore is not None:
                    self._pending[key] = restore
                else:
                    del self._pending[key]

    def _write(self, key: str, write: Write) -> None:
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

    def _victims(self, tier: Tier, write: Write) -> list[str] | None:
        """What `write` would evict in `tier` now (its entry is made once: the put that follows takes the same)."""
        entry = write.entry(self._codecs[tier.name])
        return None if entry is None else tier.victims(tier.footprint(entry))

    def write_down(self, key: str, found_at: int) -> None:
        """Queue the entry a tensor tier holds (hit there) for the tiers below it, which admission may have
        kept it out of so far (not pending: the tiers below need no read of it until the writer asks)."""
        below = found_at + 1
        if self._closed or not self.admission.filters or below >= len(self.tiers):
            return
        tier, reading = self.tiers[found_at], self._readings[self.tiers[found_at].name]

        def entry(codec: Codec) -> Entry | None:
            held = tier.get(key, reading)  # the tensors, as they are there now (None: evicted since)
            return None if held is None else Entry.of_tensors(held.kv, codec)
        self._behind.submit(key, Write(entry, start=below))

    # --- deletes, flush, close --------------------------------------------------------------------

    def delete_in_tiers(self, key: str) -> bool:
        return any([t.delete(key) for t in self.tiers])  # a list, so every tier is asked

    def delete(self, key: str) -> bool:
        """Delete from every tier and the pending chunks; a write of `key` queued before this never lands."""
        self._behind.forget(key)
        with self._lock:
            was_pending = self._pending.pop(key, None) is not None  # its bytes are given back when it is done
        return self.delete_in_tiers(key) or was_pending

    def flush(self) -> None:
        """Wait until every chunk handed over has been written (or failed)."""
        self._behind.flush()

    def close(self) -> None:
        """Write what is queued, then stop the thread; later put_nowait calls are refused."""
        with self._lock:
            self._closed = True
        self._behind.close()

    def stats(self) -> dict[str, Any]:
        """The queue now (chunks, pending chunks and bytes, its bounds), write errors, and put_nowait refusals by
        the bound that refused them (`dropped_puts_by`: entries, bytes, closed) and their bytes."""
        with self._lock:
            return {"put_queue": self._behind.pending(), "put_errors": self._behind.errors,
                    "pending": len(self._pending), "pending_bytes": self._pending_bytes,
                    "put_queue_max": self.queue_entries, "put_queue_max_bytes": self.queue_bytes,
                    "dropped_puts_by": dict(self._dropped), "dropped_put_bytes": self._dropped_bytes,
                    "admission": self.admission.policy}
