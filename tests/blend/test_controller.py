"""The loading controller: a pure function of measured costs (no model), and the calibration that measures them."""
from __future__ import annotations

import pytest

from blend.controller import Calibration, ChunkCost, Rates, Source, overlap_share, plan_loading

LAYERS, COST = 30, 20e-6          # 20 µs per token per layer (SmolLM2 on this CPU, roughly)
LAYER_BYTES_PER_TOKEN = 768       # SmolLM2 fp16: 2 * 3 heads * 64 dims * 2 bytes


def chunk(tokens: int, tier: str, codec: str = "fp16", per_token: float = LAYER_BYTES_PER_TOKEN) -> ChunkCost:
    return ChunkCost(tokens, (Source(tier, codec, int(tokens * per_token)),))


def plan(chunks, bandwidth, floor=0.15, suffix=20, decode=None, overlap=1.0):
    return plan_loading(chunks, Rates(COST, bandwidth, decode or {}), floor=floor, suffix_tokens=suffix,
                        overlap=overlap)


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
    after_question = plan(chunks, bandwidth, overlap=share)
    assert after_question.ratio < whole.ratio and after_question.ratio >= 0.15


def test_a_chunk_in_a_tier_slower_than_recomputing_it_is_recomputed_from_text():
    # 1 MB/s: a 600-token chunk takes 0.46 s a layer to load, 12 ms to recompute
    p = plan([chunk(600, "memory"), chunk(600, "far"), chunk(600, "memory")], {"memory": 5e9, "far": 1e6})
    assert p.load == [True, False, True] and [s and s.tier for s in p.sources] == ["memory", None, "memory"]
    assert "chunk 1 recomputed from text" in p.reason and p.ratio == 0.15
    assert p.as_dict()["recompute_from_text"] == [1]


def test_a_slow_decode_makes_recomputing_cheaper_even_over_a_fast_link():
    # A 600-token chunk, 115 kB a layer: 12 ms a layer to recompute. 1 GB/s reads it in 0.1 ms, but a decode
    # of 4 MB/s takes 29 ms: recompute. At 400 MB/s the decode is 0.3 ms: load.
    small = chunk(600, "redis", "cachegen", per_token=LAYER_BYTES_PER_TOKEN / 4)
    assert plan([small], {"redis": 1e9}, decode={"cachegen": 4e6}).load == [False]
    assert plan([small], {"redis": 1e9}, decode={"cachegen": 400e6}).load == [True]


def test_of_several_tiers_holding_a_chunk_the_cheapest_is_taken():
    # disk fp16 at 200 MB/s: 2.3 ms a layer; Redis cachegen at 1 GB/s, a quarter of the bytes, 500 MB/s decode
    both = ChunkCost(600, (Source("disk", "fp16", 600 * 768), Source("redis", "cachegen", 600 * 192)))
    rates = {"disk": 200e6, "redis": 1e9}
    assert plan([both], rates, decode={"cachegen": 500e6}).sources[0].tier == "redis"
    assert plan([both], rates, decode={"cachegen": 20e6}).sources[0].tier == "disk"  # a slow decode: disk
    at_hand = ChunkCost(40)  # a piece computed already: no source, kept, free
    p = plan([at_hand, both], rates, decode={"cachegen": 500e6})
    assert p.load == [True, True] and p.sources[0] is None and p.as_dict()["load_from"] == [None, "redis"]


@pytest.mark.parametrize("floor", [0.0, 0.15, 0.5, 1.0])
@pytest.mark.parametrize("bandwidth", [1e6, 30e6, 100e6, 1e9, 1e12])
def test_never_below_the_floor_and_never_above_one(floor, bandwidth):
    p = plan([chunk(300, "t"), chunk(900, "t")], {"t": bandwidth}, floor=floor)
    assert floor <= p.ratio <= 1.0


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="floor"):
        plan([chunk(10, "t")], {"t": 1e9}, floor=1.5)
    with pytest.raises(ValueError, match="recompute cost"):
        plan_loading([], Rates(0.0), floor=0.1, suffix_tokens=1)


def test_calibration_follows_live_measurements():
    cal = Calibration(alpha=0.5)
    assert cal.rates() is None  # nothing measured: the controller keeps the floor
    cal.observe_compute(1000 * 30, 0.6)                   # 20 µs per token-layer
    cal.observe_tier("disk", 2_000_000, 2e-3)             # 1 GB/s
    assert cal.recompute_s == pytest.approx(20e-6) and cal.bandwidth["disk"] == pytest.approx(1e9)
    cal.observe_tier("disk", 2_000_000, 6e-3)             # slower now: the average moves half-way
    assert cal.bandwidth["disk"] == pytest.approx((1e9 + 2e6 / 6e-3) / 2)
    cal.observe_tier("redis", 1000, 0.0)                  # no time measured: nothing learnt
    assert "redis" not in cal.snapshot()["tier_bandwidth_mb_s"]


def test_calibration_reads_the_stores_running_counts_since_it_last_looked():
    cal = Calibration(alpha=1.0)  # the latest reads alone
    tiers = {"disk": {"layer_bytes": 4_000_000, "layer_s_total": 0.004}}
    codecs = {"cachegen": {"bytes": 1_000_000, "token_layers": 5000, "decode_s_total": 0.01}}
    cal.observe_reads(tiers, codecs)
    assert cal.bandwidth["disk"] == pytest.approx(1e9) and cal.decode_rate["cachegen"] == pytest.approx(1e8)
    assert cal.estimate("redis", "cachegen", 600) == Source("redis", "cachegen", 120_000)  # 200 B a token-layer
    assert cal.estimate("redis", "int4", 600) is None  # never read: no price
    # 1 MB more in 0.1 s: the rate of the new reads, not of the running totals
    cal.observe_reads({"disk": {"layer_bytes": 5_000_000, "layer_s_total": 0.104}}, codecs)
    assert cal.bandwidth["disk"] == pytest.approx(1e7) and cal.decode_rate["cachegen"] == pytest.approx(1e8)
