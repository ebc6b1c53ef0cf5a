"""The patched attention: sdpa whose causal mask comes from absolute positions.

Registered with transformers' AttentionInterface under BLEND_ATTENTION. During a blended
prefill the queries are a subset of the prompt (the selected tokens) while the keys cover the
whole prompt, so "causal" must compare absolute positions, not row/column indices. The blend
loop passes `query_positions` [Tq] and `key_positions` [Tk]; any other forward (decode,
precompute) passes neither and gets plain sdpa with the model's own mask. An `attention_probe`
callable, when passed, sees (module, query, key) first: selection policies read the question's
attention through it.
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

BLEND_ATTENTION = "ragblend_sdpa"


def position_causal_mask(query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """Boolean [1, 1, Tq, Tk]: query at position p sees keys at positions <= p."""
    return (key_positions[None, :] <= query_positions[:, None])[None, None]


def blend_attention_forward(module, query, key, value, attention_mask, query_positions=None,
                            key_positions=None, attention_probe=None, **kwargs):
    # query: [B, Hq, Tq, D]; key/value: [B, Hkv, Tk, D]
    if attention_probe is not None:
        attention_probe(module, query, key)
    if query_positions is not None:
        if query_positions.numel() == key_positions.numel():  # every token: sdpa's own causal kernel is faster
            attention_mask, kwargs["is_causal"] = None, True
        else:
            attention_mask, kwargs["is_causal"] = position_causal_mask(query_positions, key_positions), False
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(BLEND_ATTENTION, blend_attention_forward)
AttentionMaskInterface.register(BLEND_ATTENTION, sdpa_mask)
