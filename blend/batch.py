"""Batched decoding: one forward step for several requests, each with its own BlendCache.

The batch runs through the model's own decoder layers as one [B, 1] input: embeddings, projections,
MLPs and the LM head are batched matmuls. Only attention differs per row, since every request has
its own cache length: `BatchCache.update()` appends row b's new K/V to request b's cache (an O(1)
write into its buffer) and returns the rows' K/V as a `RaggedKV`; the attention function
(blend.attention, which dispatches here) attends each row's query over its own keys. No padding,
no copy of any cache per token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from blend.cache import BlendCache


@dataclass
class RaggedKV:
    """Per-row K or V of one layer: tensors [1, H, T_b, D], one per batch row (T_b differs)."""

    rows: list[torch.Tensor]


class BatchCache(DynamicCache):
    """The caches of the rows of one decode step, seen by the model as one cache."""

    def __init__(self, caches: Sequence[BlendCache]):
        super().__init__()
        self.caches = list(caches)
        self.layers = self.caches[0].layers  # what HF reads for layer count / lengths; rows differ, see update

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # key_states/value_states: [B, H, 1, D], row b the new token of cache b
        keys, values = [], []
        for b, cache in enumerate(self.caches):
            k, v = cache.append(layer_idx, key_states[b:b + 1], value_states[b:b + 1])
            keys.append(k)
            values.append(v)
        return RaggedKV(keys), RaggedKV(values)


def ragged_attention_forward(module, query: torch.Tensor, key: RaggedKV, value: RaggedKV, attention_mask,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """Each batch row's query attends over its own cache: query [B, Hq, 1, D] -> output [B, 1, Hq, D]."""
    kwargs.pop("is_causal", None)
    rows = [sdpa_attention_forward(module, query[b:b + 1], k, v, None, is_causal=False, **kwargs)[0]
            for b, (k, v) in enumerate(zip(key.rows, value.rows))]
    return torch.cat(rows), None
