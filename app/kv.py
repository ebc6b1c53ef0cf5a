"""Chunk text → ChunkKV: read from the tiered store, or precomputed (and stored) on a miss."""
from __future__ import annotations

import logging
from typing import Literal

from blend import Blender, ChunkKV, PromptFormat, hash_ids
from store import TieredStore, decode, encode, kv_key

log = logging.getLogger("ragblend.kv")

COMPUTED = "computed"


class ChunkKVCache:
    """Owns the prompt head's KV and every chunk's, keyed by (model, context, passage tokens).

    `precompute="head"` computes each chunk right after the prompt head (closer to a full
    prefill, the default by measurement); "zero" computes it alone from position 0.
    """

    def __init__(self, blender: Blender, prompt: PromptFormat, store: TieredStore,
                 precompute: Literal["head", "zero"] = "head"):
        self.blender, self.prompt, self.store = blender, prompt, store
        self.head_ids = prompt.head_ids
        self.context_ids = self.head_ids if precompute == "head" else []
        self._head: ChunkKV | None = None

    def head(self) -> ChunkKV:
        """The prompt head's KV (exact: computed at position 0 with nothing before it)."""
        if self._head is None:
            self._head, _ = self._load(self.head_ids, [])
        return self._head

    def passage_ids(self, text: str, title: str | None = None) -> list[int]:
        return self.prompt.passage_ids(text, title)

    def key(self, text: str, title: str | None = None) -> str:
        return self._key(self.passage_ids(text, title), self.context_ids)

    def get_or_compute(self, text: str, title: str | None = None) -> tuple[ChunkKV, str]:
        """The chunk's KV and where it came from: a tier name or "computed"."""
        return self._load(self.passage_ids(text, title), self.context_ids)

    def ensure(self, text: str, title: str | None = None) -> str:
        """Make sure the chunk's KV is stored (ingest); returns its key."""
        ids = self.passage_ids(text, title)
        key = self._key(ids, self.context_ids)
        if not self.store.contains(key):
            self.store.put(key, self._compute(ids, self.context_ids))
        return key

    def delete(self, key: str) -> None:
        self.store.delete(key)

    def _key(self, ids: list[int], context_ids: list[int]) -> str:
        return kv_key(self.blender.fingerprint, hash_ids(context_ids), ids)

    def _load(self, ids: list[int], context_ids: list[int]) -> tuple[ChunkKV, str]:
        key = self._key(ids, context_ids)
        kv, tier = self.store.get_with_tier(key)
        if kv is not None and kv.token_ids.tolist() == ids:
            return kv, tier
        kv = self._compute(ids, context_ids)
        self.store.put(key, kv)
        # What a later hit will read back (the codec's fp16/int8 values), so a question gets the same
        # answer whether its chunks were just computed or came from the store.
        return decode(encode(kv, self.store.codec), verify_checksum=False), COMPUTED

    def _compute(self, ids: list[int], context_ids: list[int]) -> ChunkKV:
        context = self.head() if context_ids and context_ids == self.head_ids else None
        return self.blender.precompute(ids, context_ids, context=context)
