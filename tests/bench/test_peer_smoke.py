"""bench/peer.py runs small: both sights for each weight setting asked, the figures it promises, the quality block
and the plot; the peer engine's side runs where llama-cpp-python is installed and is said to be skipped where not.
(Its numbers are not checked: no timed assertions.)"""
from __future__ import annotations

import importlib.util

import pytest

from tests.bench.test_smoke import MUSIQUE, bench, needs_musique


@pytest.mark.slow
@needs_musique
def test_peer_bench_runs_small(tmp_path):
    out = tmp_path / "peer.json"
    result = bench("peer.py", "--dataset", str(MUSIQUE), "--limit", "1", "--passages", "2", "--answer-tokens", "4,8",
                   "--weights", "float32,int4", "--quality-tokens", "4", "--streams", "2", "--out", str(out))
    engines = {"ragblend_float32", "ragblend_int4"}
    if importlib.util.find_spec("llama_cpp") is None:
        assert "not installed" in result["llama_cpp"] and not result["ratio_to_llama_cpp"]
    else:
        engines.add("llama_cpp")
        assert set(result["ratio_to_llama_cpp"]) == {"ragblend_float32", "ragblend_int4"}
    assert set(result["summary"]) == engines == set(result["streams_tokens_per_s"])
    for figures in result["summary"].values():
        for sight in ("first", "second"):
            assert figures[sight]["ttft_s"] > 0 and figures[sight]["decode_ms_per_token"] > 0
            assert figures[sight]["end_to_end_8_s"] > figures[sight]["end_to_end_4_s"]
    quality = result["quality"]["int4"]
    assert quality["questions"] == 1 and 0 <= quality["same_answers"] <= 1 and quality["kl_full"] >= 0
    assert {"commit", "loadavg_before", "loadavg_after", "threads"} <= set(result) and out.exists()
    assert result["plot_note"] is not None or (tmp_path / "peer.png").stat().st_size > 0
