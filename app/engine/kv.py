"""The prompt head's KV and the collection's passages' (ingest), and reads of any entry by key.

A passage is keyed by (model, the tokens it was computed after: the prompt head or none, and its collection when
that is a tenant's (retrieval.documents: tenant: another tenant never finds it, nor learns the text exists), its
own tokens);
the head by (model, nothing, its tokens). Any other span of a prompt is keyed by app.engine.planner, which reads
it here (`lookup_key`, `open_key`: store reads only, safe off the model thread) and stores it from the
prefill's own KV.
"""
from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import cached_property
from typing import Literal

from blend import Blender, ChunkKV, PromptFormat, hash_ids
from blend.pipeline import LayerSource
from store import TieredStore, kv_key

log = logging.getLogger("ragblend.kv")


class ChunkKVCache:
    """Owns the prompt head's KV and every passage's, keyed by (model, context, passage tokens).

    `precompute="head"` computes each passage right after the prompt head (closer to a full
    prefill, the default by measurement); "zero" computes it alone from position 0.
    `on_served(key, source)` hears where each retrieved passage's KV came from (app.engine.usage).
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

    @cached_property
    def head_key(self) -> str:
        """The store key of the prompt head's KV (asked at every lookup of a plan)."""
        return kv_key(self.blender.fingerprint, hash_ids([]), self.head_ids)

    def passage_ids(self, chunk_ids: Sequence[int], title: str | None = None) -> list[int]:
        return self.prompt.passage_ids(chunk_ids, title)

    def key(self, ids: Sequence[int], collection: str = "") -> str:
        """The store key of a passage's KV (microseconds: a hash of the ids)."""
        return kv_key(self.blender.fingerprint, self.passage_context(collection), list(ids))

    def passage_context(self, collection: str = "") -> str:
        """The context a passage's entry is named by: what it is computed after, salted with a tenant's collection
        (the shared one, "", is not)."""
        if not collection:
            return self._context_hash
        return hashlib.sha256(f"{self._context_hash}\x00collection={collection}".encode()).hexdigest()

    def ensure(self, ids: Sequence[int], collection: str = "") -> str:
        """Make sure the passage's KV is stored (ingest) for `collection`; returns its key."""
        key = self.key(ids, collection)
        if not self.store.contains(key):
            self.compute_put(ids, collection)
        return key

    def compute_put(self, ids: Sequence[int], collection: str = "") -> str:
        """Compute the passage's KV and store it for `collection` (the model's part of `ensure`); returns its key."""
        kv = self._compute(list(ids), self.context_ids)
        self.store.put(key := self.key(ids, collection), replace(kv, context_hash=self.passage_context(collection)))
        return key

    def delete(self, key: str) -> None:
        self.store.delete(key)

    # ---- any span of a prompt, by its key (app.engine.planner decides the keys): read off the model thread --------

    def served(self, ids: Sequence[int], source: str, collection: str = "") -> None:
        """Report where a retrieved passage's KV came from (a tier name or COMPUTED) to `on_served`."""
        self.on_served(self.key(ids, collection), source)

    def context_hash(self) -> str:
        """The hash of the tokens a passage is precomputed after (the head, or none): a span's content key's."""
        return self._context_hash

    def lookup_key(self, key: str, ids: Sequence[int]) -> tuple[ChunkKV | None, str | None]:
        """The entry `key` if it holds `ids`, and its tier; (None, None) on a miss. The head: its exact copy."""
        if key == self.head_key and list(ids) == self.head_ids:
            return self.head(), "memory"
        kv, tier = self.store.get_with_tier(key)
        if kv is not None and kv.token_ids.tolist() == list(ids):
            return kv, tier
        return None, None

    def open_key(self, key: str, ids: Sequence[int]) -> tuple[ChunkKV | LayerSource | None, str | None]:
        """The entry `key` opened for per-layer reads (a pipelined prefill reads and closes it) if it holds `ids`,
        and its tier; (None, None) on a miss. Reads only the entry's head."""
        if key == self.head_key and list(ids) == self.head_ids:
            return self.head(), "memory"
        entry = self.store.open(key)  # staged as the store's placement says
        if entry is None:
            return None, None
        if entry.token_ids.tolist() != list(ids):
            entry.close()
            return None, None
        return entry, entry.tier

    def _compute(self, ids: list[int], context_ids: list[int]) -> ChunkKV:
        context = self.head() if context_ids and context_ids == self.head_ids else None
        return self.blender.precompute(ids, context_ids, context=context)

