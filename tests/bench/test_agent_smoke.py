"""bench/agent.py runs: a two-turn trace per rule, each mode over it, the JSON it promises and the plot.
(Its numbers are not checked: no timed assertions.)"""
from __future__ import annotations

import pytest

from tests.bench.test_smoke import bench, needs_musique


@pytest.mark.slow
@needs_musique
def test_agent_trace_runs_every_rule_and_mode(tmp_path):
    plot = tmp_path / "agent.png"
    result = bench("agent.py", "--turns", "2", "--window", "1", "--answer-tokens", "2", "--result-words", "20",
                   "--threads", "1", "--plot", str(plot))
    assert set(result["runs"]) == {"append", "window", "rerank"} and plot.stat().st_size > 0
    for rule, run in result["runs"].items():
        assert set(run["modes"]) == {"full", "prefix", "blend"}
        assert set(run["ratios"]) == {"blend_vs_prefix", "blend_vs_full", "prefix_vs_full"}
        for mode in run["modes"].values():
            assert len(mode["prefill_s"]) == len(mode["kl"]) == 2 and mode["total_prefill_s"] > 0
        # The second turn finds the first turn's messages in the store in every mode but full.
        assert run["modes"]["full"]["cached_tokens"] == [0, 0]
        assert run["modes"]["prefix"]["cached_tokens"][1] > 0 and run["modes"]["blend"]["cached_tokens"][1] > 0
    append = result["runs"]["append"]["modes"]
    assert append["prefix"]["exact_tokens"][1] == append["prefix"]["cached_tokens"][1] > 0  # an exact prefix
    assert append["blend"]["exact_tokens"][1] > 0 and max(append["prefix"]["kl"]) < 1e-3  # prefix caching is exact
    assert {"commit", "loadavg_before", "loadavg_after", "threads"} <= set(result)
