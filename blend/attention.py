"""The patched attention: sdpa whose causal mask comes from absolute positions.

Registered with transformers' AttentionInterface under BLEND_ATTENTION. During a blended
prefill the queries are a subset of the prompt (the selected tokens) while the keys cover the
whole prompt, so "causal" must compare absolute positions, not row/column indices. The blend
loop passes `query_positions` [Tq] and `key_positions` [Tk]; any other forward (decode,
precompute) passes neither and gets plain sdpa with the model's own mask. A batched decode step
(blend.batch) passes K/V as RaggedKV, one cache per row, and each row attends over its own.
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from blend.batch import RaggedKV, ragged_attention_forward

BLEND_ATTENTION = "ragblend_sdpa"


def position_causal_mask(query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """Boolean [1, 1, Tq, Tk]: query at position p sees keys at positions <= p."""
    return (key_positions[None, :] <= query_positions[:, None])[None, None]


def blend_attention_forward(module, query, key, value, attention_mask, query_positions=None,
                            key_positions=None, **kwargs):
    # query: [B, Hq, Tq, D]; key/value: [B, Hkv, Tk, D]
    if isinstance(key, RaggedKV):
        return ragged_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if query_positions is not None:
        if query_positions.numel() == key_positions.numel():  # every token: sdpa's own causal kernel is faster
            attention_mask, kwargs["is_causal"] = None, True
        else:
            attention_mask, kwargs["is_causal"] = position_causal_mask(query_positions, key_positions), False
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(BLEND_ATTENTION, blend_attention_forward)
AttentionMaskInterface.register(BLEND_ATTENTION, sdpa_mask)
