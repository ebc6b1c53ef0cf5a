"""blend.pipeline in the app: passages read layer by layer give the same answers; a damaged layer is recomputed."""
from __future__ import annotations

import pytest

from app.engine.query import QueryParams, QueryStats
from store.serialize import parse_head

pytestmark = pytest.mark.slow


def test_pipelined_and_whole_loading_answer_alike_and_a_damaged_layer_is_recomputed(corpus, engine_with):
    question = corpus.questions[0][0]
    _, whole = engine_with(blend={"pipeline": False}, store={"memory_bytes": 0})   # disk only
    _, piped = engine_with(blend={"pipeline": True}, store={"memory_bytes": 0})
    params = QueryParams(question, max_tokens=8)
    a, b = whole.answer(params), piped.answer(params)
    assert b.stats.store_hits == {"disk": 2} and a.stats.store_hits == {"disk": 2}
    assert (b.answer, b.stats.recomputed_tokens) == (a.answer, a.stats.recomputed_tokens)

    # Damage layer 5 of the first passage on disk: the pipelined prefill finds it mid-way, recomputes it.
    plan, _ = whole.plan(params, 8, QueryStats("blend"))
    passage = next(s for s in plan.spans if s.kind == "passage")
    path = piped.parts.store.tiers[0]._cache.peek_file(piped.parts.kv_cache.key(passage.ids))
    data = bytearray(open(path, "rb").read())
    offset, length = parse_head(bytes(data)).layer_range(5)
    data[offset + length // 2] ^= 0x20
    open(path, "wb").write(bytes(data))

    c = piped.answer(params)
    assert c.stats.store_hits == {"computed": 1, "disk": 1}
    assert c.answer == a.answer and piped.parts.store.stats()["corrupt"] == 1
    assert piped.answer(params).stats.store_hits == {"disk": 2}   # stored again, whole


def test_ratio_auto_follows_the_loading_controller(corpus, engine_with):
    _, engine = engine_with(blend={"ratio": "auto", "ratio_floor": 0.2}, store={"memory_bytes": 0})
    params = QueryParams(corpus.questions[1][0], max_tokens=4)
    first = engine.answer(params)   # nothing measured yet: the floor
    assert first.stats.loading["reason"].startswith("not calibrated") and first.stats.recompute_ratio == 0.2
    assert engine.calibration.recompute_s > 0 and engine.calibration.bandwidth["disk"] > 0

    second = engine.answer(params)  # disk loads hide behind compute here: the floor, with the reason
    loading = second.stats.loading
    assert loading["ratio"] >= 0.2 and second.stats.recompute_ratio == pytest.approx(loading["ratio"], abs=1e-3)
    assert loading["recompute_from_text"] == [] and "tier_bandwidth_mb_s" in loading

    engine.calibration.alpha = 0.0                  # freeze what it learnt...
    engine.calibration.bandwidth["disk"] = 1000.0   # ...and pretend the disk reads 1 kB/s
    third = engine.answer(params)
    assert third.stats.loading["recompute_from_text"] == [1, 2]   # both passages (0 is the prompt head)
    assert "recomputed from text" in third.stats.loading["reason"]
    assert third.stats.store_hits == {"computed": 2} and third.stats.recompute_ratio == 0.2
