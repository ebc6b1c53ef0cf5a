"""The tiers that keep encoded entries (disk, Redis, the in-process BytesTier): checked on the way out.

A byte tier implements five byte operations - `get_bytes`, `reader` (byte ranges of one entry), `head`
(an entry's first bytes), `put_bytes`, `remove` - plus contains/size_of/keys/stats; `ByteTier` turns them into the
Tier interface: `get` decodes and checks the whole entry, `open` reads and checks only its head and hands
the rest to a LayeredEntry, `put` writes the entry's bytes (through the tier's own write-behind thread when
it has one: `write_behind`, the queue's size). `trusted` tiers hold bytes that never left this process
(the layers' digests are not checked again).
"""
from __future__ import annotations

import logging
from abc import abstractmethod

from common.chunk_kv import KVMismatchError
from store.base import Entry, EntryHooks, Reading, Tier
from store.keys import kv_key, validate_key
from store.layered import LayeredEntry, RangeReader
from store.serialize import HEAD_BYTES, OPEN_BYTES, decode, head_nbytes, parse_head, read_header
from store.write_behind import WriteBehind

log = logging.getLogger("ragblend.store")


class ByteTier(Tier):
    trusted = False

    def __init__(self, write_behind: int = 0) -> None:
        self.write_behind = WriteBehind(self.put_bytes, self.remove, write_behind) if write_behind else None

    # --- what a byte tier implements ----------------------------------------------------------------

    @abstractmethod
    def get_bytes(self, key: str) -> bytes | None: ...

    @abstractmethod
    def reader(self, key: str) -> RangeReader | None:
        """Byte ranges of the entry under `key`, as it is now (refreshes its recency once)."""

    @abstractmethod
    def head(self, key: str, nbytes: int) -> bytes | None:
        """The first `nbytes` of an entry, without touching its recency."""

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def remove(self, key: str) -> bool: ...

    # --- the Tier interface -------------------------------------------------------------------------

    def get(self, key: str, reading: Reading = Reading()) -> Entry | None:
        data = self.get_bytes(key)
        if data is None:
            return None
        kv = decode(data, reading.fingerprint, verify_checksum=not self.trusted)
        _check_names(key, kv.fingerprint, kv.context_hash, kv.token_ids)
        return Entry.of_bytes(data, kv)

    def open(self, key: str, reading: Reading, hooks: EntryHooks) -> LayeredEntry | None:
        reader = self.reader(key)
        if reader is None:
            return None
        try:
            data, want = b"", OPEN_BYTES
            while len(data) < want:  # a second read only for a head longer than the first
                data = bytes(reader.read(0, want))
                if len(data) < want:
                    break  # the whole entry is shorter: parse_head says what is missing
                want = max(want, head_nbytes(data))
            head = parse_head(data, reading.fingerprint, verify_checksum=not self.trusted)
            _check_names(key, head.header["fingerprint"], head.header["context_hash"], head.token_ids)
        except OSError as exc:  # gone or unreachable while read: a miss
            reader.close()
            log.debug("store: reading %s from %s failed: %s", key[:12], self.name, exc)
            return None
        except BaseException:
            reader.close()
            raise
        return LayeredEntry(key, self.name, head, data[:head.head_nbytes], reader, hooks,
                            verify=not self.trusted, reading=reading)

    def put(self, key: str, entry: Entry) -> None:
        validate_key(key)
        data = entry.data  # encoded here, on the caller's thread: a bad KV fails its put
        if self.write_behind is None:
            self.put_bytes(key, data)
        else:
            self.write_behind.submit(key, data)

    def delete(self, key: str) -> bool:
        validate_key(key)
        if self.write_behind is not None:
            self.write_behind.forget(key)
        return self.remove(key)

    def footprint(self, entry: Entry) -> int:
        return len(entry.data)

    def fingerprint_of(self, key: str) -> str | None:
        head = self.head(key, HEAD_BYTES)
        return None if head is None else read_header(head)["fingerprint"]

    def write_stats(self) -> dict[str, int]:
        """For a tier that writes behind, its stats' `write_queue` (writes waiting) and `dropped_writes`."""
        behind = self.write_behind
        return {} if behind is None else {"write_queue": behind.pending(), "dropped_writes": behind.dropped}

    def flush(self) -> None:
        if self.write_behind is not None:
            self.write_behind.flush()

    def close(self) -> None:
        if self.write_behind is not None:
            self.write_behind.close()


def _check_names(key: str, fingerprint: str, context_hash: str, token_ids) -> None:
    if kv_key(fingerprint, context_hash, token_ids) != key:
        raise KVMismatchError("entry is not the KV its key names")
