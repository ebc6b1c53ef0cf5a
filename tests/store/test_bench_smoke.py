"""The store's bench scripts run on the store's API: each with tiny sizes on the CPU, in a subprocess, printing
the JSON it promises (bench/store.py: the tiers and codecs; bench/pipeline.py: TTFT per tier, on SmolLM2;
bench/remote.py: TTFT per codec from Redis behind a throttled link; bench/kv_bytes.py and bench/codec_quality.py:
each codec's bytes and quality on SmolLM2)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from store import CODEC_NAMES

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def bench(script: str, *args: str) -> dict:
    """Run bench/`script` from this checkout; its stdout's JSON."""
    done = subprocess.run([sys.executable, str(REPO / "bench" / script), *args], capture_output=True, text=True,
                          timeout=800, env=os.environ | {"PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_bench_store_reports_every_tier_and_codec():
    report = bench("store.py", "--tokens", "16", "--chunks", "2", "--repeats", "1")
    assert report["device"] == "cpu" and report["chunk"]["tokens"] == 16 and report["recompute_s"] > 0
    tiers = ["memory", "disk"] + ["redis"] * bool(shutil.which("redis-server"))
    assert set(report["codecs"]) == set(CODEC_NAMES)
    for codec in CODEC_NAMES:
        assert list(report["codecs"][codec]) == tiers
        for figures in report["codecs"][codec].values():
            for case in ("get_s", "all_layers_s", "loader_serial_s", "loader_parallel_s"):
                assert figures[case] > 0, (codec, case)
    # Per KV shape and codec: bytes/token and the encode/decode rates.
    for model, (L, H, D) in {"smollm2-135m": (30, 3, 64), "llama-3-8b": (32, 8, 128)}.items():
        rates = report["rates"][model]
        assert set(rates) == set(CODEC_NAMES)
        assert rates["fp16"]["bytes_per_token"] == L * H * D * 4 + 8
        assert rates["int4"]["bytes_per_token"] == L * (H * D + 4 * H * D // 16 + 4 * H) + 8  # 16 tokens: one key group
        assert rates["cachegen"]["bytes_per_token"] < 2 * L * H * D  # under a byte a value
        assert all(r[k] > 0 for r in rates.values() for k in ("encode_mb_s", "decode_mb_s", "layer_decode_mb_s"))


def test_bench_store_measures_the_codecs_asked_for():
    report = bench("store.py", "--tokens", "8", "--chunks", "1", "--repeats", "1", "--codecs", "int4,cachegen")
    assert set(report["codecs"]) == set(report["rates"]["llama-3-8b"]) == {"int4", "cachegen"}
    done = subprocess.run([sys.executable, str(REPO / "bench" / "store.py"), "--codecs", "int3"], capture_output=True,
                          text=True, env=os.environ | {"PYTHONPATH": str(REPO)})
    assert done.returncode == 2 and "unknown codecs ['int3']" in done.stderr


def test_bench_pipeline_reports_ttft_per_tier_and_way(musique):
    report = bench("pipeline.py", "--passages", "1", "--repeats", "1", "--tiers", "memory,disk",
                   "--bandwidth", "1000")
    ways = {"pipelined", "whole", "auto"}
    assert report["passages"] == 1 and report["prompt_tokens"] > 0 and report["kv_mb"] > 0
    for figures in ("ttft_s", "vs_memory", "load_wait_ms"):
        assert set(report[figures]) == {"memory", "disk"}
        assert all(set(by_way) == ways for by_way in report[figures].values())
    assert all(t > 0 for by_way in report["ttft_s"].values() for t in by_way.values())
    assert report["vs_memory"]["memory"]["pipelined"] == 1.0
    assert set(report["controller"]) == {"memory", "disk"}  # "auto" ran on both: the open entries' layer sizes
    assert all(plan["ratio"] >= report["ratio"] for plan in report["controller"].values())
    assert report["calibration"] and report["commit"]


def test_bench_remote_reports_ttft_per_codec_behind_a_throttled_link(musique):
    report = bench("remote.py", "--passages", "1", "--codecs", "fp16,cachegen", "--throttle-mbit", "1000")
    assert report["link_mbit_s"] == 1000 and "simulated" in report["simulated_link"]
    assert report["passages"] == 1 and report["prompt_tokens"] > 0 and report["full_prefill_s"] > 0
    assert set(report["codecs"]) == {"fp16", "cachegen"}
    for figures in report["codecs"].values():  # every byte crossed the proxy: stored, then read back
        assert figures["ttft_s"]["fixed"] > 0 and figures["ttft_s"]["auto"] > 0
        assert figures["controller"]["ratio"] >= report["ratio"]
        assert figures["controller"]["tier_bandwidth_mb_s"]["redis"] > 0
    assert report["codecs"]["cachegen"]["kv_mb"] < report["codecs"]["fp16"]["kv_mb"] / 4
    assert report["codecs"]["cachegen"]["controller"]["codec_decode_mb_s"]["cachegen"] > 0
    assert isinstance(report["auto_never_slower_than_full"], bool) and report["commit"]


def test_bench_kv_bytes_and_codec_quality_measure_every_codec_on_smollm2(musique, tmp_path):
    plans = tmp_path / "plans.json"
    plans.write_text(json.dumps({"K16 V16": {"keys": [[0, 16]], "values": [[0, 16]]}}))
    sizes = bench("kv_bytes.py", "--limit", "1", "--passages", "1", "--plans", str(plans))
    codecs = sizes["codecs"]
    assert {"native", "fp16", "int8", "int4", "cachegen:K16 V16"} <= set(codecs) and sizes["test_tokens"] > 0
    assert codecs["cachegen:K16 V16"]["bytes_per_token"] < codecs["int4"]["bytes_per_token"] < codecs["int8"][
        "bytes_per_token"]
    quality = bench("codec_quality.py", "--limit", "1", "--passages", "1", "--codecs", "native,int8,int2,K16 V16",
                    "--plans", str(plans))
    means = quality["means"]
    assert set(means) == {"native", "int8", "int2", "K16 V16"} and quality["n"] == 1 and quality["commit"]
    for by_mode in means.values():
        assert set(by_mode) == {"reuse", "query@0.15"}
        assert all(m["kl"] >= 0 and 0 <= m["top1"] <= 1 for m in by_mode.values())
    assert quality["plans"]["K16 V16"] == {"keys": [[0, 16]], "values": [[0, 16]]}


def test_bench_admission_compares_the_policies_on_one_stream():
    report = bench("admission.py", "--requests", "30", "--recurring", "10", "--one-offs", "0,5")
    runs = {(r["one_offs"], r["policy"]): r for r in report["results"]}
    assert set(runs) == {(n, p) for n in (0, 5) for p in ("everywhere", "second_sight", "frequency")}
    assert all(0 <= r["recurring_hit_rate"] <= 1 and r["recurring_lookups"] > 0 for r in runs.values())
