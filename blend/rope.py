"""Move cached keys to new positions: RoPE rotations compose, R(p + d) = R(d) R(p).

Keys are cached rotated for their chunk-local positions; placing a chunk `d` positions later
means rotating its keys by `d * θ_i`, using the model's own `inv_freq` (so `rope_theta` and
linear / llama3 / yarn scaling are followed). Values carry no position. This is exact only
when the angle is linear in the position with a fixed `inv_freq`; other variants are refused.
"""
from __future__ import annotations

import sys

import torch
from transformers import PreTrainedModel

# Angle = position * inv_freq with inv_freq fixed: a shift is one more rotation.
LINEAR_ROPE_TYPES = {"default", "linear", "llama3", "yarn"}


class RopeUnsupportedError(RuntimeError):
    """The model's RoPE cannot be shifted exactly (the blender falls back to full prefill)."""


def rope_type(config) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params.get("rope_type", params.get("type", "default"))


class RopeShifter:
    def __init__(self, model: PreTrainedModel):
        config = model.config.get_text_config(decoder=True)
        kind = rope_type(config)
        if kind not in LINEAR_ROPE_TYPES:
            raise RopeUnsupportedError(f"rope_type {kind!r} is not linear in the position; cannot shift cached keys")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        inv_freq = model.model.rotary_emb.inv_freq  # [head_dim / 2]
        partial = (getattr(config, "rope_parameters", None) or {}).get(
            "partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        if partial != 1.0 or inv_freq.numel() * 2 != head_dim:
            raise RopeUnsupportedError(f"partial rotary embeddings ({inv_freq.numel() * 2} of {head_dim} dims) "
                                       "are not handled")
        self.inv_freq = inv_freq.detach().to(torch.float64)
        # The model's own rotation, so the half-split layout always matches its attention.
        self._apply_rotary = sys.modules[type(model.model.layers[0].self_attn).__module__].apply_rotary_pos_emb

    def shift(self, keys: torch.Tensor, delta: int) -> torch.Tensor:
        """Rotate keys [..., T, D] by `delta` positions (negative moves them back)."""
        if delta == 0:
            return keys
        angle = delta * self.inv_freq                  # [D/2], float64: large positions stay exact
        angle = torch.cat([angle, angle])[None]        # [1, D] in the rotate_half layout
        cos, sin = angle.cos().to(keys.dtype), angle.sin().to(keys.dtype)
        # cos/sin broadcast over [..., T, D]; a one-token "query" keeps the unused half of the work small
        _, rotated = self._apply_rotary(keys[..., :1, :], keys, cos, sin)
        return rotated
