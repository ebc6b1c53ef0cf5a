"""Every benchmark script runs: each at its smallest settings on the CPU, in a subprocess, printing the JSON it
promises. (Their numbers are not checked here: no timed assertions; bench/device_check.py and bench/decode.py's
CUDA form are smoked in tests/blend/test_device_check.py, bench/store.py and bench/pipeline.py with the store.)"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MUSIQUE = REPO.parent / "shared" / "data" / "musique_dev.json"
needs_musique = pytest.mark.skipif(not MUSIQUE.exists(), reason=f"shared evaluation data missing: {MUSIQUE}")


def bench(script: str, *args: str, timeout: int = 900) -> dict:
    """The JSON `bench/<script>` prints on stdout (run from the repository, on the CPU)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(REPO / "bench" / script), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_decode_times_every_cpu_form():
    result = bench("decode.py", "--model", "tiny", "--context", "40", "--batches", "1,2", "--steps", "2")
    assert result["device"] == "cpu" and result["context_tokens"] == 40 and result["threads"] >= 1
    forms = {"layers", "sdpa", "plain"} | ({"kernel"} if result["cpu_kernels"] else set())
    assert set(result["forms"]) == {"kernel", "layers", "sdpa", "plain"}
    assert (result["kernel_step_refusal"] is None) == result["cpu_kernels"]
    for form in forms:
        rows = result["forms"][form]
        assert set(rows) == {"1", "2"}
        for row in rows.values():
            assert set(row) == {"step_ms", "per_token_ms", "step_vs_first"} and row["step_ms"] > 0
    assert {"commit", "loadavg_before", "loadavg_after"} <= set(result)


@pytest.mark.slow
@needs_musique
def test_ttft_reports_both_baselines():
    """Full prefill as HF runs it and through the blend loop's own attention, and each mode against both."""
    result = bench("ttft.py", "--passages", "1", "--repeats", "1", "--modes", "reuse,blend@0.15", "--threads", "1")
    assert result["passages"] == 1 and result["prompt_tokens"] > 100
    assert result["full_s"] > 0 and result["full_kernels_s"] > 0
    assert set(result["ratios"]) == {"full_kernels", "reuse", "blend@0.15"}
    assert set(result["ratios_vs_full_kernels"]) == {"reuse", "blend@0.15"}
    assert set(result["ttft_s"]) == set(result["cpu_s"]) == set(result["phases_ms"]) == {
        "full", "full_kernels", "reuse", "blend@0.15"}
    assert "assemble" in result["phases_ms"]["blend@0.15"] and "layers" in result["phases_ms"]["full"]
    assert result["threads"] == 1 and result["fingerprint"] and result["commit"]


@pytest.mark.slow
@needs_musique
def test_serve_compares_the_batched_server_with_one_at_a_time():
    result = bench("serve.py", "--questions", "1", "--passages", "1", "--top-k", "1", "--max-tokens", "2",
                   "--concurrency", "1", timeout=1200)
    assert result["questions"] == 1 and result["chunks"] >= 1 and result["max_tokens"] == 2
    for server in ("batched", "one_at_a_time"):
        for mode in ("blend", "full"):
            run = result["results"][server][mode]["c1"]
            assert run["requests"] == 2 and run["output_tokens_per_s"] > 0 and run["ttft_p50_s"] > 0
            assert {"tbt_p50_ms", "server_prefill_p50_ms", "server_step_ms_by_rows", "server_steps_by_rows"} <= set(run)
    assert set(result["throughput_vs_one_at_a_time"]) == {"blend", "full"}
    assert set(result["blend_ttft_p50_over_full"]) == {"batched", "one_at_a_time"}


@pytest.mark.slow
def test_followup_scores_every_strategy():
    result = bench("followup.py", "--top-k", "2")
    assert result["documents"] > 0 and result["top_k"] == 2
    assert set(result["strategies"]) == {"alone", "always", "rule", "rule_user"}
    for scores in result["strategies"].values():
        assert set(scores) == {"follow_ups", "switches", "all"}
        for group in scores.values():
            assert set(group) == {"hit@1", "hit@2", "n"} and 0 <= group["hit@1"] <= group["hit@2"] <= 1
    assert set(result["rule_says_follow_up"]) == {"follow_ups", "switches"}


@pytest.mark.slow
def test_ingest_measures_embedding_precompute_and_search():
    result = bench("ingest.py", "--chunks", "4", "--kv-chunks", "1", "--sizes", "200", "--kinds", "flat",
                   "--queries", "5")
    assert result["embed"]["chunks"] == 4 and result["embed"]["chunks_per_s"] > 0
    assert result["kv_precompute"]["chunks"] == 1 and result["kv_precompute"]["tokens_per_s"] > 0
    (search,) = result["search"]
    assert search["size"] == 200 and search["kind"] == "flat" and search["p50_ms"] > 0


@pytest.mark.skipif(shutil.which("initdb") is None, reason="PostgreSQL is not installed")
def test_scale_follows_a_writer_through_postgres():
    result = bench("scale.py", "--base", "200", "--insert", "150", "--searches", "5")
    assert result["base_chunks"] == 200 and result["inserted_chunks"] == 150 and result["deleted_chunks"] == 150
    for key in ("open_build_s", "change_check_ms_p50", "insert_s", "catch_up_s", "full_rebuild_s",
                "delete_catch_up_s"):
        assert result[key] >= 0, key
    assert set(result["search_ms_before_insert"]) == set(result["search_ms_after_insert"]) == {"p50", "p95"}


@pytest.mark.slow
@needs_musique
def test_page_prices_explain_off_and_on():
    result = bench("page.py", "--questions", "1", "--passages", "1", "--requests", "1", "--top-k", "1",
                   "--max-tokens", "2")
    off, on = result["explain_off"], result["explain_on"]
    assert set(off) == set(on) == {"e2e_ms", "ttft_ms", "prefill_ms", "bytes"}
    assert on["bytes"] > off["bytes"]  # the explain part is in the response
    assert result["page_files_ms_p50"] > 0 and result["explain_build_ms"] > 0 and result["scores_fill_us"] > 0


@pytest.mark.slow
def test_leases_keeps_the_leased_context_in_memory_through_churn():
    result = bench("leases.py", "--passages", "1", "--words", "30", "--churn", "1.5", "--memory-slack", "0",
                   "--repeats", "1")
    leased, unleased = result["results"]["leased"], result["results"]["unleased"]
    assert leased["lease"]["status"] == "held" and leased["full_memory_hit_after_churn"]
    assert leased["after_churn_store_hits"] == {"memory": 1} and leased["memory_lease_held"] > 0
    assert unleased["lease"] is None and not unleased["full_memory_hit_after_churn"]  # fell to disk
    assert unleased["churn_bytes"] >= 1.5 * unleased["memory_bytes"] and unleased["memory_evictions"] > 0
    assert {"ttft_after_over_hit", "hit_ttft_ms", "after_churn_ttft_ms"} <= set(leased)
    assert {"commit", "loadavg_before", "loadavg_after"} <= set(result)


@pytest.mark.slow
@needs_musique
def test_embed_lane_uploads_beside_a_maximal_embeddings_call():
    result = bench("embed_lane.py", "--calls", "1", "--delay", "0")
    assert result["inputs_per_call"] == 256 and 0 < result["pieces_per_input"] <= 254
    assert result["embeddings"][0]["status"] == 200 and result["upload_status"] == 201
    assert result["lane_embeds_after_s"] > 0 and result["upload_s"] > 0 and result["upload_alone_s"] > 0
    assert result["target_met"] == (result["upload_s"] <= 10)
    assert {"commit", "loadavg_before", "loadavg_after", "upload_lane_wait_s"} <= set(result)
