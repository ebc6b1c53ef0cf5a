"""The patched attention: little more than the work the causal mask allows, for any sorted set of query positions.

Registered with transformers' AttentionInterface under BLEND_ATTENTION. During a blended prefill
the queries are a subset of the prompt (every non-exact token up to the check layer, then the
selected tokens and the question) while the keys cover the whole prompt, so "causal" compares
absolute positions. One sdpa call over every key with an explicit [Tq, Tk] mask would be exact, but
it computes every key for every query, the hidden ones included (half the work of a long run of
queries). An `AttentionPlan` cuts the queries into groups that each span at most KEY_WINDOW
positions and runs each group against the keys up to its last query: a query computes fewer than
KEY_WINDOW keys it cannot see, and only a group of several queries needs a mask:

    queries p0..p1 (p1 - p0 < KEY_WINDOW):  keys [0, p1]; key j visible to query p where j <= p

The plan is built once per set of query positions (the prefill loop keeps them over many layers)
and passed as `attention_plan`; `plan.attend(...)` runs it. That is the CPU backend's plan where its C
kernel cannot run (blend.backend: a float32 model gets blend.cpu_kernels.prefill_attention, bfloat16 this);
on CUDA the backend plans FlexAttention instead, behind the same `attend`. Any other forward (decode,
precompute, full prefill) passes no plan and gets plain sdpa with the model's own mask. An
`attention_probe` callable, when passed, sees (module, query, key) first: selection policies read the
question's attention through it.
A decode step (blend.batch) passes K/V as PooledKV, views of the KV pool, and every row attends over its
own keys in one call (`pooled_attention_forward`: the model's own attention math, its sliding window and
logit softcapping included, for any model; `blend_attention` dispatches a model the gate refused here too).
"""
from __future__ import annotations

import bisect
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.nn import functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

BLEND_ATTENTION = "ragblend_sdpa"
# Positions a query group may span: wider groups mean fewer calls but more hidden keys computed; 512 is also
# the CPU flash kernel's key block (measured in BENCHMARKS.md).
KEY_WINDOW = 512


@dataclass(frozen=True)
class Piece:
    """One sdpa call: a run of (sorted) queries against keys [0, keys)."""
    queries: slice
    keys: int  # the last query's position + 1


@dataclass(frozen=True)
class AttentionPlan:
    positions: torch.Tensor     # [Tq] absolute query positions, strictly increasing
    pieces: tuple[Piece, ...]   # the query groups, in order; together they cover every query once

    @classmethod
    def build(cls, positions: torch.Tensor, window: int = KEY_WINDOW) -> AttentionPlan:
        pos = positions.tolist()
        if not pos:
            raise ValueError("an attention plan needs at least one query")
        if any(b <= a for a, b in zip(pos, pos[1:])) or pos[0] < 0:
            raise ValueError("query positions must be non-negative and strictly increasing")
        pieces, start = [], 0
        while start < len(pos):
            end = bisect.bisect_left(pos, pos[start] + window, lo=start)  # the queries within `window` positions
            pieces.append(Piece(slice(start, end), pos[end - 1] + 1))
            start = end
        return cls(positions, tuple(pieces))

    @property
    def num_keys(self) -> int:
        """Keys the queries can see (up to the last query's position)."""
        return int(self.positions[-1]) + 1

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scale: float | None = None) -> torch.Tensor:
        return planned_attention(query, key, value, self, scale)


def planned_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: AttentionPlan,
                      scale: float | None = None) -> torch.Tensor:
    """Causal attention of queries at `plan.positions` over keys at positions 0..; returns [B, Tq, Hq, D].

    query: [B, Hq, Tq, D]; key/value: [B, Hkv, Tk, D] with Tk >= plan.num_keys (GQA: Hq a multiple of Hkv).
    """
    if query.shape[2] != plan.positions.numel() or key.shape[2] < plan.num_keys:
        raise ValueError(f"attention plan for {plan.positions.numel()} queries over {plan.num_keys} keys got "
                         f"{query.shape[2]} queries and {key.shape[2]} keys")
    out = query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])  # [B, Tq, Hq, D]
    gqa = query.shape[1] != key.shape[1]
    for piece in plan.pieces:
        positions = plan.positions[piece.queries].to(query.device)                          # [Tg]
        # a lone query sees every key up to its own position: no mask
        mask = (torch.arange(piece.keys, device=query.device)[None, :] <= positions[:, None]
                if positions.numel() > 1 else None)                                          # [Tg, keys] bool
        o = F.scaled_dot_product_attention(query[:, :, piece.queries], key[:, :, :piece.keys],
                                           value[:, :, :piece.keys], attn_mask=mask, scale=scale,
                                           enable_gqa=gqa)                                   # [B, Hq, Tg, D]
        out[:, piece.queries] = o.transpose(1, 2)
    return out


def dense_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor,
                    scale: float | None = None) -> torch.Tensor:
    """The reference: sdpa with an explicit position mask over every key; returns [B, Tq, Hq, D]."""
    num_keys = int(positions[-1]) + 1
    key, value = key[:, :, :num_keys], value[:, :, :num_keys]
    mask = torch.arange(num_keys, device=query.device)[None, :] <= positions.to(query.device)[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                                           enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous()


@dataclass
class PooledKV:
    """One layer's K or V for a decode step's rows (blend.batch.PoolView): a view [rows, H, columns, D] of the
    pool, `visible` [rows, 1, 1, columns] (True where a key is at or before the row's position), the rows'
    positions [rows, 1, 1, 1] and each key column's position [columns]."""

    rows: torch.Tensor
    seen: torch.Tensor
    positions: torch.Tensor
    columns: torch.Tensor

    def visible(self, window: int | None = None) -> torch.Tensor:
        """[rows, 1, 1, columns]: the keys a row's query sees; within the last `window` positions where a
        sliding window applies (HF's: key > position - window)."""
        return self.seen if window is None else self.seen & (self.columns > self.positions - window)


def pooled_attention_forward(module, query: torch.Tensor, key: PooledKV, value: PooledKV, attention_mask,
                             scaling: float | None = None, sliding_window: int | None = None,
                             softcap: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query [rows, Hq, 1, D] over each row's visible keys → [rows, 1, Hq, D]. The Hq/Hkv query heads that
    share a KV head become that head's query rows, so K/V are read once, never repeated."""
    rows, hq, _, dim = query.shape
    hkv = key.rows.shape[1]
    grouped = query.view(rows, hkv, hq // hkv, dim)                                  # [rows, Hkv, G, D]
    visible = key.visible(sliding_window)                                            # [rows, 1, 1, T]
    keys, values = (kv.rows.to(query.dtype) for kv in (key, value))  # a pool of other elements (float16), as floats
    if softcap is None:
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=visible, scale=scaling)
    else:  # sdpa cannot cap the scores: HF's eager attention, step by step
        scale = scaling if scaling is not None else dim ** -0.5
        scores = torch.tanh(grouped @ keys.transpose(2, 3) * scale / softcap) * softcap        # [rows, Hkv, G, T]
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1, dtype=torch.float32).to(query.dtype)
        out = weights @ values                                                       # [rows, Hkv, G, D]
    # (reshape, not view: on CUDA, sdpa's memory-efficient kernel returns a non-contiguous output)
    return out.reshape(rows, 1, hq, dim), None                                      # head h·G + g, as HF's repeat_kv


@contextmanager
def blend_attention(model) -> Iterator[None]:
    """The model's attention dispatched to BLEND_ATTENTION while inside: a model the blend gate refused keeps its
    own attention for its prefills, and decodes through the pool with the pooled attention (the same math)."""
    own = model.config._attn_implementation
    if own == BLEND_ATTENTION:
        yield
        return
    # the config's own setter (set_attn_implementation refuses a model without sdpa support: this is not sdpa)
    model.config._attn_implementation = BLEND_ATTENTION
    try:
        yield
    finally:
        model.config._attn_implementation = own


def blend_attention_forward(module, query, key, value, attention_mask, attention_plan: AttentionPlan | None = None,
                            attention_probe=None, **kwargs):
    # query: [B, Hq, Tq, D]; key/value: [B, Hkv, Tk, D]
    if isinstance(key, PooledKV):
        return pooled_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if attention_probe is not None:
        attention_probe(module, query, key)
    if attention_plan is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    # The Blender's model gate keeps these away; refuse rather than silently ignore them.
    if kwargs.get("softcap") is not None:
        raise ValueError("the blend attention does not apply attention-logit softcapping")
    window = kwargs.get("sliding_window")
    if window is not None and attention_plan.num_keys > window:
        raise ValueError(f"the blend attention does not apply a sliding window ({window} < "
                         f"{attention_plan.num_keys} keys)")
    return attention_plan.attend(query, key, value, kwargs.get("scaling")), None


AttentionInterface.register(BLEND_ATTENTION, blend_attention_forward)
AttentionMaskInterface.register(BLEND_ATTENTION, sdpa_mask)
