"""The loading controller: a pure function of measured costs (no model)."""
from __future__ import annotations

import pytest

from blend.controller import Calibration, ChunkCost, overlap_share, plan_loading

LAYERS, COST = 30, 20e-6          # 20 µs per token per layer (SmolLM2 on this CPU, roughly)
LAYER_BYTES_PER_TOKEN = 768       # SmolLM2 fp16: 2 * 3 heads * 64 dims * 2 bytes


def chunk(tokens: int, tier: str) -> ChunkCost:
    return ChunkCost(tokens, tier, tokens * LAYER_BYTES_PER_TOKEN)


def plan(chunks, bandwidth, floor=0.15, suffix=20):
    return plan_loading(chunks, floor=floor, suffix_tokens=suffix, num_layers=LAYERS, recompute_s=COST,
                        bandwidth=bandwidth)


def test_fast_tiers_keep_the_floor():
    p = plan([chunk(600, "memory")] * 5, {"memory": 5e9})
    assert p.ratio == 0.15 and all(p.load) and "hidden at the floor" in p.reason
    assert p.compute_ms_per_layer >= p.load_ms_per_layer


def test_loading_that_dominates_raises_the_ratio_just_enough():
    # 100 MB/s: 5 * 600 * 768 B = 2.3 MB per layer = 23 ms; compute at 0.15: 20 µs * 470 = 9.4 ms
    p = plan([chunk(600, "remote")] * 5, {"remote": 100e6})
    assert 0.15 < p.ratio < 1.0 and all(p.load)
    assert p.compute_ms_per_layer == pytest.approx(p.load_ms_per_layer)  # the smallest ratio that hides it
    assert "raised" in p.reason


def test_a_question_pass_leaves_less_load_to_hide():
    chunks, bandwidth = [chunk(600, "remote")] * 5, {"remote": 100e6}
    whole = plan(chunks, bandwidth)
    share = overlap_share(range(0, 24), LAYERS)   # the query policy's question pass: layers 0..23 first
    assert share == pytest.approx(0.2) and overlap_share(None, LAYERS) == 1.0
    after_question = plan_loading(chunks, floor=0.15, suffix_tokens=20, num_layers=LAYERS, recompute_s=COST,
                                  bandwidth=bandwidth, overlap=share)
    assert after_question.ratio < whole.ratio and after_question.ratio >= 0.15


def test_a_chunk_in_a_tier_slower_than_recomputing_it_is_recomputed_from_text():
    # 1 MB/s: a 600-token chunk takes 14 s to load, 0.36 s to recompute
    p = plan([chunk(600, "memory"), chunk(600, "far"), chunk(600, "memory")], {"memory": 5e9, "far": 1e6})
    assert p.load == [True, False, True]
    assert "chunk 1 recomputed from text" in p.reason and p.ratio == 0.15
    assert p.as_dict()["recompute_from_text"] == [1]


@pytest.mark.parametrize("floor", [0.0, 0.15, 0.5, 1.0])
@pytest.mark.parametrize("bandwidth", [1e6, 30e6, 100e6, 1e9, 1e12])
def test_never_below_the_floor_and_never_above_one(floor, bandwidth):
    p = plan([chunk(300, "t"), chunk(900, "t")], {"t": bandwidth}, floor=floor)
    assert floor <= p.ratio <= 1.0


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="floor"):
        plan([chunk(10, "t")], {"t": 1e9}, floor=1.5)
    with pytest.raises(ValueError, match="recompute cost"):
        plan_loading([], floor=0.1, suffix_tokens=1, num_layers=2, recompute_s=0.0, bandwidth={})


def test_calibration_follows_live_measurements():
    cal = Calibration(alpha=0.5)
    cal.observe_compute(1000 * 30, 0.6)                   # 20 µs per token-layer
    cal.observe_tier("disk", 2_000_000, 2.0)              # 1 GB/s
    assert cal.recompute_s == pytest.approx(20e-6) and cal.bandwidth["disk"] == pytest.approx(1e9)
    cal.observe_tier("disk", 2_000_000, 6.0)              # slower now: the average moves half-way
    assert cal.bandwidth["disk"] == pytest.approx((1e9 + 2e6 / 6e-3) / 2)
    cal.observe_tier("redis", 1000, None)                 # no reads yet: nothing learnt
    assert "redis" not in cal.snapshot()["tier_bandwidth_mb_s"]
