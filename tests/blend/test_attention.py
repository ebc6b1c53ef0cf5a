"""The planned blend attention equals sdpa with an explicit position mask, and skips what the mask hides."""
from __future__ import annotations

import types

import pytest
import torch

from blend.attention import KEY_WINDOW, AttentionPlan, blend_attention_forward, dense_attention, planned_attention

D = 64


def qkv(num_queries: int, num_keys: int, heads: tuple[int, int] = (9, 3), seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads[0], num_queries, D, generator=g)
    k = torch.randn(1, heads[1], num_keys, D, generator=g) * 2  # peaky scores: masking errors show
    v = torch.randn(1, heads[1], num_keys, D, generator=g)
    return q, k, v


def scattered(first: int, last: int, share: float, suffix: int, seed: int = 0) -> torch.Tensor:
    """A sorted share of positions in [first, last) plus a contiguous suffix after it (blend's later layers)."""
    g = torch.Generator().manual_seed(seed)
    picked = torch.randperm(last - first, generator=g)[: max(1, int(share * (last - first)))].sort().values + first
    return torch.cat([picked, torch.arange(last, last + suffix)])


CASES = {
    "contiguous after a prefix": (torch.arange(300, 700), 720),
    "queries equal keys": (torch.arange(0, 500), 500),
    "one query": (torch.tensor([417]), 500),
    "one query at position 0": (torch.tensor([0]), 10),
    "scattered with suffix": (scattered(200, 1400, 0.15, 20), 1420),
    "scattered from position 0": (scattered(0, 900, 0.3, 0), 900),
    "scattered, sparse": (scattered(50, 2000, 0.02, 3), 2003),
}


@pytest.mark.parametrize("window", [64, 512])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_planned_equals_dense_masked_reference(case, heads, window):
    positions, num_keys = CASES[case]
    q, k, v = qkv(positions.numel(), num_keys, heads)
    out = planned_attention(q, k, v, AttentionPlan.build(positions, window))
    reference = dense_attention(q, k, v, positions)
    assert out.shape == (1, positions.numel(), heads[0], D)
    assert (out - reference).abs().max() < 1e-4


def test_dense_reference_is_the_explicit_mask():
    positions = torch.tensor([2, 5, 6])
    q, k, v = qkv(3, 8, (2, 2))
    scores = (q @ k.transpose(-1, -2)) / D ** 0.5                                 # [1, H, 3, 8]
    scores = scores.masked_fill(torch.arange(8)[None, :] > positions[:, None], float("-inf"))
    expected = (scores.softmax(-1) @ v).transpose(1, 2)
    assert (dense_attention(q, k, v, positions) - expected).abs().max() < 1e-5


def work(plan: AttentionPlan) -> int:
    """Query-key pairs the sdpa calls compute: each query group against every key up to its last query."""
    return sum((piece.queries.stop - piece.queries.start) * piece.keys for piece in plan.pieces)


@pytest.mark.parametrize("positions", [torch.arange(1000, 5000), scattered(1000, 6000, 0.15, 30)],
                         ids=["contiguous", "scattered"])
def test_plans_skip_hidden_keys(positions):
    visible = int((positions + 1).sum())  # pairs the causal mask allows
    plan = AttentionPlan.build(positions)
    dense = positions.numel() * plan.num_keys
    assert work(plan) < 1.1 * visible < 0.8 * dense
    assert all(piece.keys - int(positions[piece.queries][0]) <= KEY_WINDOW for piece in plan.pieces)


def test_plan_rejects_unsorted_or_empty_positions():
    for bad in ([3, 2], [1, 1], [], [-1, 4]):
        with pytest.raises(ValueError):
            AttentionPlan.build(torch.tensor(bad, dtype=torch.long))
    q, k, v = qkv(2, 4)
    with pytest.raises(ValueError, match="keys"):
        planned_attention(q, k, v, AttentionPlan.build(torch.tensor([1, 7])))


def test_registered_forward_uses_the_plan_and_the_module_scale():
    positions = scattered(100, 700, 0.2, 5)
    q, k, v = qkv(positions.numel(), 705)
    module = types.SimpleNamespace(num_key_value_groups=3, is_causal=True, training=False)
    out, weights = blend_attention_forward(module, q, k, v, None, attention_plan=AttentionPlan.build(positions),
                                           scaling=0.05, dropout=0.0)
    assert weights is None
    assert (out - dense_attention(q, k, v, positions, scale=0.05)).abs().max() < 1e-4
    assert (out - dense_attention(q, k, v, positions)).abs().max() > 1e-2  # the scale mattered
    # Without a plan: the model's own sdpa path (decode, precompute, full prefill).
    plain, _ = blend_attention_forward(module, q[:, :, :5], k[:, :, :5], v[:, :, :5], None, scaling=0.05)
    assert (plain - dense_attention(q[:, :, :5], k, v, torch.arange(5), scale=0.05)).abs().max() < 1e-4


def test_registered_forward_refuses_what_it_cannot_apply():
    q, k, v = qkv(3, 50)
    module = types.SimpleNamespace(num_key_value_groups=3)
    plan = AttentionPlan.build(torch.tensor([10, 30, 49]))
    with pytest.raises(ValueError, match="softcap"):
        blend_attention_forward(module, q, k, v, None, attention_plan=plan, softcap=30.0)
    with pytest.raises(ValueError, match="sliding window"):
        blend_attention_forward(module, q, k, v, None, attention_plan=plan, sliding_window=32)
    out, _ = blend_attention_forward(module, q, k, v, None, attention_plan=plan, sliding_window=64)
    assert (out - dense_attention(q, k, v, plan.positions)).abs().max() < 1e-4
