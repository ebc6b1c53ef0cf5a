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
        self._half_split = _is_half_split(self._apply_rotary, head_dim)

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

    def rotation(self, deltas: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin in `dtype` rotating token t by deltas[t] positions ([T] int64), for `place`: computed once
        per prompt, the same float64 angles cast to `dtype` as `shift` uses, so `place` equals it bit for bit.
        [T, D/2] for the rotate_half layout (both halves turn by the same angles), else [T, D]."""
        angle = deltas.to(self.inv_freq.device, torch.float64)[:, None] * self.inv_freq[None]   # [T, D/2]
        if not self._half_split:
            angle = torch.cat([angle, angle], dim=-1)                                         # [T, D]
        return angle.cos().to(dtype), angle.sin().to(dtype)

    def place(self, out: torch.Tensor, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """out [..., T, D] = keys [..., T, D] rotated by per-token cos/sin (from `rotation`): every chunk of a
        layer in one batched rotation, written straight into the prompt buffer."""
        if not self._half_split:  # another layout: the model's own rotation, then a copy
            out.copy_(_model_rotation(self._apply_rotary, keys, cos, sin))
            return
        rotate_half_into(out, keys, cos, sin)


def rotate_half_into(out: torch.Tensor, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """HF's `keys * cos + rotate_half(keys) * sin`, written into `out` with fewer passes over memory:
    first half k1·c − k2·s, second half k2·c + k1·s (cos/sin [T, D] repeat over the halves, so [T, D/2]
    will do: contiguous, it is read faster). The same roundings in the same order (x + (−y) is x − y
    exactly), so the same bits."""
    half = keys.shape[-1] // 2
    k1, k2, c, s = keys[..., :half], keys[..., half:], cos[..., :half], sin[..., :half]
    torch.mul(k1, c, out=out[..., :half]).sub_(k2 * s)
    torch.mul(k2, c, out=out[..., half:]).add_(k1 * s)


def _is_half_split(apply_rotary, head_dim: int) -> bool:
    """Whether the model's rotation is the rotate_half form `rotate_half_into` computes (checked bit for bit)."""
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 3, head_dim, generator=g)
    angle = torch.rand(3, head_dim // 2, generator=g, dtype=torch.float64) * 100
    cos, sin = torch.cat([angle, angle], -1).cos().float(), torch.cat([angle, angle], -1).sin().float()
    out = torch.empty_like(keys)
    rotate_half_into(out, keys, cos, sin)
    return torch.equal(out, _model_rotation(apply_rotary, keys, cos, sin))


def _model_rotation(apply_rotary, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # keys [H, T, D], cos/sin [T, D] as HF lays them out: keys [1, H, T, D], cos/sin [1, T, D]
    keys = keys[None]
    return apply_rotary(keys[..., :1, :], keys, cos[None], sin[None])[1][0]
