"""One stored chunk, read a layer at a time: what a pipelined prefill loads while it computes.

`TieredStore.open(key)` reads and checks only the entry's head (header and token ids) from the
first tier holding it and returns a `LayeredEntry`; `entry.layer(i)` then reads, checks and
decodes layer i alone. A layer that fails its checksum raises `LayerReadError` and the store
drops the entry from that tier (counted as corrupt): the caller recomputes the chunk, it never
gets wrong KV.

Promotion: an entry read layer by layer from a slower tier is copied whole into the faster tiers
when it is closed after every layer was read and checked (the sections read are kept for that,
so it costs no second read); an entry closed earlier is not promoted.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Protocol

import torch

from common.chunk_kv import ChunkKV
from store.serialize import CorruptEntryError, EntryHead, decode_layer, decoded_dtype

if TYPE_CHECKING:
    from store.tiered import Tier, TieredStore

log = logging.getLogger("ragblend.store")


class RangeReader(Protocol):
    """Byte ranges of one stored entry, as a tier's `reader(key)` opens it. Thread-safe."""

    def read(self, offset: int, length: int) -> bytes | memoryview: ...  # fewer bytes past the end
    def close(self) -> None: ...


class LayerReadError(RuntimeError):
    """A layer could not be read: treat the chunk as a miss. `corrupt`: its bytes were damaged
    (the store has dropped the entry); otherwise the entry went away (deleted, expired, Redis
    unreachable) while it was being read."""

    def __init__(self, message: str, corrupt: bool) -> None:
        super().__init__(message)
        self.corrupt = corrupt


class LayeredEntry:
    """A stored ChunkKV opened for per-layer reads. Use as a context manager, or close() it.

    Attributes: key, tier (name of the tier it is read from), codec, shape [L, H, T, D],
    num_layers, dtype (what layers decode to: float16 for fp16, float32 for int8), token_ids [T],
    position, context_hash, fingerprint, nbytes (the stored entry), layer_nbytes (one layer's
    section). `layer(i)` may be called from any thread, in any order.
    """

    def __init__(self, store: TieredStore, tier: Tier, tier_index: int, key: str, head: EntryHead,
                 head_bytes: bytes, reader: RangeReader, pin_memory: bool = False) -> None:
        self._store, self._tier, self._tier_index = store, tier, tier_index
        self.key, self._head, self._reader = key, head, reader
        self.tier = tier.name
        self.codec, self.shape, self.num_layers = head.codec, head.shape, head.num_layers
        self.dtype = decoded_dtype(head.codec)
        self.token_ids = head.token_ids
        self.position = head.header["position"]
        self.context_hash = head.header["context_hash"]
        self.fingerprint = head.header["fingerprint"]
        self.nbytes = head.nbytes
        self.layer_nbytes = head.layer_range(0)[1] if head.num_layers else 0
        # Page-locked buffers only mean something (and only work) with CUDA.
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self._lock = threading.Lock()
        self._failed: str | None = None
        self._closed = False
        # Sections kept for promotion: only when there is a faster tier to promote into.
        self._sections: dict[int, bytes] | None = {} if tier_index > 0 else None
        self._head_bytes = head_bytes

    def layer(self, i: int, device: torch.device | None = None, dtype: torch.dtype | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys [H, T, D], values [H, T, D]) of layer `i`: read, checked and decoded on its own, then
        moved to `device` in `dtype` when given (blend.pipeline.LayerSource).

        Raises LayerReadError (the chunk is a miss) and IndexError for a layer out of range.
        """
        offset, length = self._head.layer_range(i)
        with self._lock:
            if self._failed is not None or self._closed:
                raise LayerReadError(f"entry {self.key[:12]}: {self._failed or 'closed'}", corrupt=False)
        start = time.perf_counter()
        try:
            section = self._reader.read(offset, length)
        except OSError as exc:
            self._fail(f"read failed: {exc}")
            raise LayerReadError(f"entry {self.key[:12]} in {self.tier}: reading layer {i} failed: {exc}",
                                 corrupt=False) from exc
        try:
            if len(section) != length and not self._tier.contains(self.key):
                raise LayerReadError(f"entry {self.key[:12]} went away from {self.tier} while being read",
                                     corrupt=False)
            keys, values = decode_layer(self._head, i, section, verify_checksum=not self._tier.trusted,
                                        pin_memory=self.pin_memory)
        except CorruptEntryError as exc:
            if self._fail(f"layer {i} is damaged: {exc}"):  # two threads on a bad entry: dropped once
                self._store._drop(self._tier, self.key, exc)
            raise LayerReadError(f"entry {self.key[:12]} in {self.tier}: layer {i} is damaged ({exc}); "
                                 "the entry was dropped", corrupt=True) from exc
        except LayerReadError as exc:
            self._fail(str(exc))
            raise
        self._store._count_layer(self._tier, length, time.perf_counter() - start)
        with self._lock:
            if self._sections is not None:
                self._sections[i] = bytes(section)
        return keys.to(device, dtype, non_blocking=True), values.to(device, dtype, non_blocking=True)

    def read_all(self) -> ChunkKV:
        """Every layer, stacked: the ChunkKV `TieredStore.get` would return."""
        layers = [self.layer(i) for i in range(self.num_layers)]
        _, H, T, D = self.shape
        keys = torch.stack([k for k, _ in layers]) if layers else torch.empty((0, H, T, D), dtype=self.dtype)
        values = torch.stack([v for _, v in layers]) if layers else torch.empty((0, H, T, D), dtype=self.dtype)
        return ChunkKV(keys, values, self.token_ids, self.position, self.context_hash, self.fingerprint)

    def _fail(self, reason: str) -> bool:
        """Mark the entry failed; True for the first failure."""
        with self._lock:
            first, self._failed = self._failed is None, self._failed or reason
            self._sections = None
            return first

    def close(self) -> None:
        """Release the tier's handle; promote the entry if every layer was read. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            sections, self._sections = self._sections, None
        self._reader.close()
        if sections is not None and len(sections) == self.num_layers:
            data = b"".join([self._head_bytes, *(sections[i] for i in range(self.num_layers))])
            self._store._promote(self.key, data, self._tier_index)

    def __enter__(self) -> LayeredEntry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
