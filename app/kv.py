"""Prompt pieces → ChunkKV: read from the tiered store, or precomputed (and stored) on a miss.

Every piece is keyed by (model, the tokens before it that it was computed after, its own tokens):
passages are computed after the prompt head (or alone); the head at position 0; a conversation
piece after the head and the earlier conversation pieces — so a conversation's KV is an exact
prefix found again at the next turn, by this replica or any other sharing the store.
`lookup` only reads the store (safe off the model thread); `compute` runs the model.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Literal

import torch

from app.usage import COMPUTED
from blend import Blender, ChunkKV, PromptFormat, hash_ids
from blend.pipeline import LayerSource
from store import TieredStore, kv_key

log = logging.getLogger("ragblend.kv")


class ChunkKVCache:
    """Owns the prompt head's KV and every passage's, keyed by (model, context, passage tokens).

    `precompute="head"` computes each passage right after the prompt head (closer to a full
    prefill, the default by measurement); "zero" computes it alone from position 0.
    `on_served(key, source)` hears where each retrieved passage's KV came from (app.usage).
    """

    def __init__(self, blender: Blender, prompt: PromptFormat, store: TieredStore,
                 precompute: Literal["head", "zero"] = "head",
                 on_served: Callable[[str, str], object] = lambda key, source: None):
        self.blender, self.prompt, self.store, self.on_served = blender, prompt, store, on_served
        self.head_ids = prompt.head_ids
        self.context_ids = self.head_ids if precompute == "head" else []
        self._context_hash = hash_ids(self.context_ids)
        self._head: ChunkKV | None = None

    def head(self) -> ChunkKV:
        """The prompt head's KV, computed once (at warm-up, before the scheduler) and kept exact, never
        through the store's codec: it holds the attention sink, which a lossy codec hurts most (quantising the
        head alone, cachegen at 16 bins, raised blend@0.15's KL by 80% on 6 MuSiQue questions: BENCHMARKS.md,
        "Compressed KV"), and every passage is precomputed after it. It is stored too, under `head_key`, so that
        a lease or `ragblend store gc` finds it like any entry of a prompt; reads take this exact copy."""
        if self._head is None:
            self._head = self.blender.precompute(self.head_ids)
            self.store.put(self.head_key, self._head)
        return self._head

    @property
    def head_key(self) -> str:
        """The store key of the prompt head's KV."""
        return self.piece_key(self.head_ids, [])

    def passage_ids(self, chunk_ids: Sequence[int], title: str | None = None) -> list[int]:
        return self.prompt.passage_ids(chunk_ids, title)

    def key(self, ids: Sequence[int]) -> str:
        """The store key of a passage's KV (microseconds: a hash of the ids)."""
        return kv_key(self.blender.fingerprint, self._context_hash, list(ids))

    def piece_key(self, ids: Sequence[int], context_ids: Sequence[int]) -> str:
        """The store key of the KV of `ids` computed after `context_ids` (any piece)."""
        return kv_key(self.blender.fingerprint, hash_ids(list(context_ids)), list(ids))

    def get_or_compute(self, ids: Sequence[int]) -> tuple[ChunkKV, str]:
        """A retrieved passage's KV and where it came from: a tier name or "computed" (then stored:
        an entry Redis evicted, or one never precomputed, is back for the next query)."""
        kv, source = self._load(list(ids), self.context_ids)
        self.served(ids, source)
        return kv, source

    def ensure(self, ids: Sequence[int]) -> str:
        """Make sure the passage's KV is stored (ingest); returns its key."""
        key = self.key(ids)
        if not self.store.contains(key):
            self.store.put(key, self._compute(list(ids), self.context_ids))
        return key

    def delete(self, key: str) -> None:
        self.store.delete(key)

    # ---- any prompt piece: looked up off the model thread, computed on it ----------------------

    def served(self, ids: Sequence[int], source: str) -> None:
        """Report where a retrieved passage's KV came from (a tier name or COMPUTED) to `on_served`."""
        self.on_served(self.key(ids), source)

    def lookup(self, ids: Sequence[int], context_ids: Sequence[int]) -> tuple[ChunkKV | None, str | None]:
        """The stored KV of `ids` computed after `context_ids`, and its tier; (None, None) on a miss."""
        ids = list(ids)
        if not context_ids and ids == self.head_ids and self._head is not None:
            return self._head, "memory"
        kv, tier = self.store.get_with_tier(self.piece_key(ids, context_ids))
        if kv is not None and kv.token_ids.tolist() == ids:
            return kv, tier
        return None, None

    def open(self, ids: Sequence[int], context_ids: Sequence[int]) -> tuple[LayerSource | None, str | None]:
        """The stored KV of `ids` after `context_ids` opened for per-layer reads (a pipelined prefill reads
        and closes it), and its tier; (None, None) on a miss. Reads only the entry's head."""
        ids = list(ids)
        entry = self.store.open(self.piece_key(ids, context_ids))  # staged as the store's placement says
        if entry is None:
            return None, None
        if entry.token_ids.tolist() != ids:
            entry.close()
            return None, None
        return entry, entry.tier

    def compute(self, ids: Sequence[int], context_ids: Sequence[int], before: Sequence[ChunkKV] = ()) -> ChunkKV:
        """Precompute and store the KV of `ids` after `context_ids`; returns it as a store hit would.
        `before`: the KVs laid out in front of it that hold exactly `context_ids` (the head and earlier
        conversation pieces), so only `ids` run."""
        ids, context_ids = list(ids), list(context_ids)
        if ids == self.head_ids and not context_ids:  # the head: kept exact (`head`)
            return self.head()
        if context_ids == self.context_ids and not before:  # a passage
            kv = self._compute(ids, context_ids)
        else:
            context = _joined(before, self.blender.device, self.blender.dtype) if before else None
            kv = self.blender.precompute(ids, context_ids, context=context)
        return self.store.put(self.piece_key(ids, context_ids), kv)  # as a later hit will read it back

    def put(self, ids: Sequence[int], context_ids: Sequence[int], kv: ChunkKV) -> ChunkKV:
        """Store a piece's KV computed elsewhere (a prefill's fresh tokens) under its key."""
        return self.store.put(self.piece_key(ids, context_ids), kv)

    def put_nowait(self, ids: Sequence[int], context_ids: Sequence[int], kv: ChunkKV) -> None:
        """Hand a piece's KV (a copy cut from a prefill's cache) to the store's writer thread: encoded and
        stored in the background, found pending meanwhile (TieredStore.put_nowait)."""
        self.store.put_nowait(self.piece_key(ids, context_ids), kv)

    def tier_of(self, ids: Sequence[int], context_ids: Sequence[int]) -> str | None:
        """The first tier holding the KV of `ids` after `context_ids`, without reading it; None if none does."""
        key = self.piece_key(ids, context_ids)
        return next((tier.name for tier in self.store.tiers if tier.contains(key)), None)

    def _load(self, ids: list[int], context_ids: list[int]) -> tuple[ChunkKV, str]:
        kv, tier = self.lookup(ids, context_ids)
        if kv is not None:
            return kv, tier
        return self.compute(ids, context_ids), COMPUTED

    def _compute(self, ids: list[int], context_ids: list[int]) -> ChunkKV:
        context = self.head() if context_ids and context_ids == self.head_ids else None
        return self.blender.precompute(ids, context_ids, context=context)


def _joined(parts: Sequence[ChunkKV], device: torch.device, dtype: torch.dtype) -> ChunkKV:
    """Consecutive exact pieces (head, conversation...) as one ChunkKV, to serve as a precompute context
    (on the model's device: the pieces may come from different tiers)."""
    first = parts[0]
    return ChunkKV(torch.cat([p.keys.to(device, dtype) for p in parts], dim=2),      # [L, H, sum T, D]
                   torch.cat([p.values.to(device, dtype) for p in parts], dim=2),
                   torch.cat([p.token_ids for p in parts]), first.position, first.context_hash, first.fingerprint)
