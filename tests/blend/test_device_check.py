"""The GPU scripts' CPU smoke modes: bench/device_check.py end to end on a tiny model (its JSON and table), and
bench/decode.py's CUDA form (eager vs graphs), where capture falls back to eager and says so; the store codecs part."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


CASES = ["hf sdpa full", "full_prefill", "full through the blend attention", "resident reuse",
         *(f"resident blend@{r} {p}" for r in (0.15, 0.3) for p in ("query", "hkvd"))]
TIER_CASES = [f"{tier} {mode} {way}" for tier in ("memory", "disk") for mode in ("reuse", "blend@0.15 query")
              for way in ("pipelined", "whole")]
EXACTNESS = ["hf two pieces vs hf", "hf eager vs hf sdpa", "full_prefill vs hf", "blend@1 vs hf"]


def test_device_check_smoke_mode_runs_on_the_cpu(tmp_path):
    """Everything the GPU check reports, in the form it reports it: the gate in each dtype, the exactness table,
    every prefill case (baselines, resident blends, tier loads pipelined and whole) with synchronised phases,
    and the decode step's form and rows."""
    done = subprocess.run([sys.executable, str(REPO / "bench/device_check.py"), "--tiny", "--device", "cpu",
                           "--dtype", "float32", "--tokens", "200", "--chunk", "56", "--repeats", "1",
                           "--exact-tokens", "150", "--decode-context", "40", "--decode-batches", "1,2",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "device_check.json").read_text())
    assert {"commit", "torch", "transformers", "device", "model", "total_s"} <= set(report)
    assert report["gate"] == "accepted"
    gate = report["gates"]["torch.float32"]
    assert gate["backend"] == "cpu" and gate["unsupported"] is None
    exactness = report["exactness"]["torch.float32"]
    assert exactness["prompt_tokens"] > 100 and exactness["max_abs_logit"] > 0
    for name in EXACTNESS:
        assert set(exactness[name]) >= {"max_abs", "kl", "top1"}, name
    assert exactness["blend@1 vs hf"]["top1"] and exactness["blend@1 vs hf"]["fallback"] is None
    (run,) = report["runs"].values()
    for case in CASES + TIER_CASES:  # (the store imports here: its tier cases run)
        assert run[case]["s"] > 0, run[case]
        if case != "hf sdpa full":  # ragblend's own prefills, with their stats
            assert {"phases_ms", "load_wait_ms", "recomputed", "fallback"} <= set(run[case]), case
    assert "assemble" in run["resident reuse"]["phases_ms"] and run["resident blend@0.15 query"]["recomputed"] > 0
    assert run["full through the blend attention"]["fallback"] is None
    decode = report["decode"]
    assert decode["step"]["form"] in ("KernelStep", "LayerStep")
    for rows in ("batch 1", "batch 2"):
        assert decode[rows]["step_ms"] > 0 and decode[rows]["tokens_per_s"] > 0 and decode[rows]["graphs"] == "off"
    assert decode["own forward batch 1"]["step_ms"] > 0
    assert decode["batch 2 masked"]["tokens_inside_masks"] and decode["batch 2 masked"]["step_ms"] > 0  # the
    # grammar-constrained step: a masked row beside a free one, every masked token inside its band
    assert "hf sdpa full" in done.stdout and "decode step:" in done.stdout and "JSON:" in done.stdout.splitlines()[-1]


def test_decode_bench_cuda_form_records_each_part_and_the_graphs_fallback():
    spec = importlib.util.spec_from_file_location("bench_decode", REPO / "bench/decode.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    shape = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024)
    reports = []
    result = bench.cuda_decode_timing("cpu", context=40, batches=(1, 2), steps=3, shape=shape,
                                      progress=lambda r: reports.append(json.dumps(r)))
    assert len(reports) == 3  # after the model's own forward, then after each batch size
    assert result["blend_refused"] is None and result["own_forward_b1_ms"] > 0
    assert result["step_form"] in ("KernelStep", "LayerStep") and result["dtype"] == "float32"
    for row in result["batches"].values():
        assert row["eager"]["step_ms"] > 0 and row["graphs"]["step_ms"] > 0
        assert row["graphs_captured"] == 0 and row["graphs_fallback"].startswith("CUDA graph capture failed")
        assert row["same_tokens"]


def test_device_check_codecs_part_reads_every_codec_within_its_bound(tmp_path):
    # bfloat16, as on the GPU: each codec's bound plus the dtype's rounding
    done = subprocess.run([sys.executable, str(REPO / "bench/device_check.py"), "--only", "codecs", "--tiny",
                           "--device", "cpu", "--dtype", "bfloat16", "--repeats", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    codecs = json.loads((tmp_path / "device_check.json").read_text())["codecs"]
    assert {"native", "fp16", "int8", "int4", "cachegen"} <= set(codecs)
    for name, figures in codecs.items():
        assert figures["within_bound"] and figures["decode_mb_s"] > 0, (name, figures)
    assert codecs["cachegen"]["stored_mb"] < codecs["int4"]["stored_mb"] < codecs["int8"]["stored_mb"]
    assert "codec cachegen" in done.stdout
