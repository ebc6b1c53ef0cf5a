"""What every tier is: one abstract base (`Tier`) over one entry type (`Entry`).

An `Entry` is one chunk's KV in both forms a tier may keep: tensors (`kv`, a ChunkKV in the model's
dtype, as a hit reads it back) and the encoded entry (`data`, store.serialize's format). It is made
from one form and makes the other on first ask, once, so a put or a promotion hands the same entry to
every tier and each takes the form it keeps: the memory and gpu tiers tensors, disk and Redis bytes.
The store never asks a tier which form it keeps (LMCache's storage backends share one interface over
one payload type, `MemoryObj`, the same way).

A tier reads an entry whole (`get`) or opened for per-layer reads (`open`, a blend.pipeline.LayerSource),
raising CorruptEntryError / KVMismatchError for an entry it holds that is damaged, another model's or not
the KV its key names: the store then deletes it from that tier and counts it. What the store's reads
share, whichever tier serves them, travels as one `Reading`. Each tier owns its background work (the Redis
tier's write-behind queue) and its upkeep (`gc`), and stops the one in `close`.

Leases (store/leases.py): a tier built with `pinned` (store.eviction.Pinned) never evicts by LRU a key it
names; `size_of` and `footprint` give what a lease pins in the tier, `on_lease` hears when leases on
keys begin or end there (Redis lifts and restores the entries' TTL), `idle_s` says how long an entry
has gone unused (for the gc of entries nobody owns).
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from common.chunk_kv import ChunkKV
from common.placement import HOST, Placement
from store.serialize import Codec, CorruptEntryError, decode, encode, get_codec


class Entry:
    """One chunk's KV: `kv` for the tiers that keep tensors, `data` for those that keep bytes.

    Built from either form (a value, or a function that makes it); the other form is made from it on first
    ask and kept. Thread-safe: a write-behind thread may ask for `data` while the caller asks for `kv`.
    """

    def __init__(self, kv: ChunkKV | Callable[[], ChunkKV], data: bytes | Callable[[], bytes]) -> None:
        self._kv, self._data = kv, data
        self._lock = threading.Lock()

    @classmethod
    def computed(cls, kv: ChunkKV, codec: str | Codec) -> Entry:
        """A chunk just computed: its tensors as a hit will read them back (the codec's round trip), its
        bytes encoded from `kv` itself (encoding the round trip again would not give the same int8 scales)."""
        return cls(lambda: get_codec(codec).round_trip(kv), lambda: encode(kv, codec))  # each when a tier asks

    @classmethod
    def of_tensors(cls, kv: ChunkKV, codec: str | Codec) -> Entry:
        """A chunk a tensor tier holds (already as the codec gives it back)."""
        return cls(kv, lambda: encode(kv, codec))

    @classmethod
    def of_bytes(cls, data: bytes, kv: ChunkKV | None = None) -> Entry:
        """An encoded entry already checked (or that never left this process), and its decoded KV if known."""
        return cls(kv if kv is not None else lambda: decode(data, verify_checksum=False), data)

    @property
    def kv(self) -> ChunkKV:
        return self._form("_kv")

    @property
    def data(self) -> bytes:
        return self._form("_data")

    def _form(self, name: str) -> Any:
        with self._lock:
            if callable(made := getattr(self, name)):
                made = made()
                setattr(self, name, made)
            return made


@dataclass(frozen=True)
class Reading:
    """What every read of one store shares, whichever tier serves it."""

    codec: str | Codec = "fp16"     # a tensor tier's entry promoted into a byte tier is encoded with it
    fingerprint: str | None = None  # the model's: a byte tier refuses entries of any other (None: any model)
    placement: Placement = HOST     # layers staged in page-locked host memory when it says `pin`
    pool: Executor | None = None    # reads open entries' layers ahead (None: each layer when it is asked for)
    ahead: int = 2                  # layers of each open entry queued ahead on the pool


class EntryHooks(Protocol):
    """What an opened entry tells the store about itself (the store gives each one its own)."""

    promotes: bool  # faster tiers would take the entry once every layer was read: keep what is read for them

    def dropped(self, exc: Exception) -> None: ...  # the entry is damaged: delete it from its tier, count it
    def layer_read(self, nbytes: int, seconds: float) -> None: ...  # a layer's bytes read (and checked)
    def layer_decoded(self, codec: str, nbytes: int, tokens: int, seconds: float) -> None: ...  # ... and decoded
    def promote(self, entry: Entry) -> None: ...  # every layer was read: offer it to the faster tiers


class OpenEntry:
    """An entry opened for per-layer reads (store.layered: LayeredEntry from a byte tier, ResidentEntry from a
    tensor tier): blend.pipeline.LayerSource's attributes, a few more, and `layer(i, device, dtype)`.
    Use as a context manager, or close() it."""

    key: str
    tier: str  # the name of the tier it is read from
    codec: str
    dtype: torch.dtype  # what layers come back in by default: the model's
    shape: tuple[int, int, int, int]  # [L, H, T, D]
    num_layers: int
    token_ids: torch.Tensor  # [T]
    position: int
    context_hash: str
    fingerprint: str
    nbytes: int  # the entry as the tier holds it
    layer_nbytes: int  # one layer of it (what a load of one layer reads)
    resident = False  # a read decodes bytes a tier holds (blend.pipeline.LayerSource.resident)

    def layer(self, i: int, device: torch.device | None = None, dtype: torch.dtype | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> OpenEntry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Tier(ABC):
    """One level of the store: entries under their keys (store.keys), in whichever form suits the tier.

    Thread-safe. `get` and `open` return None on a miss and raise CorruptEntryError / KVMismatchError for
    a bad entry (the caller deletes it); `put` may drop an entry (over the cap, a full write queue).
    """

    name: str

    @abstractmethod
    def get(self, key: str, reading: Reading = Reading()) -> Entry | None:
        """The whole entry under `key`, checked."""

    @abstractmethod
    def open(self, key: str, reading: Reading, hooks: EntryHooks) -> OpenEntry | None:
        """The entry under `key` opened for per-layer reads (its head checked now, each layer when read)."""

    @abstractmethod
    def put(self, key: str, entry: Entry) -> None: ...

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove `key` (and any write of it still queued); whether it was there."""

    @abstractmethod
    def contains(self, key: str) -> bool: ...

    @abstractmethod
    def size_of(self, key: str) -> int | None:
        """The bytes the entry under `key` takes in this tier, without reading it (None: not here)."""

    @abstractmethod
    def footprint(self, entry: Entry) -> int:
        """The bytes `entry` would take in this tier (what a lease pins here for an entry not here yet)."""

    def victims(self, nbytes: int) -> list[str] | None:
        """The keys a new entry of `nbytes` would evict here now ([]: it fits in the free room), without
        changing anything; None: it cannot fit, or the tier cannot tell (Redis evicts by its own maxmemory)."""
        return None

    def on_lease(self, keys: Sequence[str], held: bool) -> None:
        """Leases on `keys` in this tier began (`held`) or the last of them ended. Nothing to do by default:
        LRU asks `pinned` at each eviction."""

    def idle_s(self, key: str) -> float | None:
        """Seconds since the entry under `key` was last read or written; None when absent or unknown here."""
        return None

    @abstractmethod
    def keys(self) -> Iterator[str]: ...

    @abstractmethod
    def fingerprint_of(self, key: str) -> str | None:
        """The model fingerprint of the entry under `key` (None: it is gone), read cheaply: for gc.
        Raises CorruptEntryError when the entry cannot say."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """At least entries, bytes, evictions and errors (None where the tier cannot know)."""

    def flush(self) -> None:
        """Wait until the tier's background writes are done (nothing to wait for by default)."""

    def close(self) -> None:
        """Stop the tier's background work (writes queued are done first) and release what it holds."""

    def gc(self, keep_fingerprint: str) -> dict[str, Any] | None:
        """Drop entries of other models, or unreadable ones; what was scanned, dropped and is left.
        None: the tier leaves its upkeep to someone else (a tier shared with replicas of other models)."""
        scanned = dropped = 0
        for key in list(self.keys()):
            try:
                fingerprint = self.fingerprint_of(key)
            except CorruptEntryError:
                fingerprint = ""  # unreadable: dropped
            if fingerprint is None:
                continue
            scanned += 1
            if fingerprint != keep_fingerprint:
                dropped += self.delete(key)
        stats = self.stats()
        return {"scanned": scanned, "dropped": dropped, "entries": stats["entries"], "bytes": stats["bytes"]}
