"""The GPU scripts' CPU smoke modes: bench/device_check.py end to end on a tiny model (its JSON and table), and
bench/decode.py's CUDA form (eager vs graphs), where capture falls back to eager and says so."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_device_check_smoke_mode_runs_on_the_cpu(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "bench/device_check.py"), "--tiny", "--device", "cpu",
                           "--dtype", "float32", "--tokens", "200", "--chunk", "56", "--repeats", "1",
                           "--exact-tokens", "150", "--decode-context", "40", "--decode-batches", "1,2",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "device_check.json").read_text())
    assert report["gate"] == "accepted" and report["gates"]["torch.float32"]["backend"] == "cpu"
    (run,) = report["runs"].values()
    for case in ("hf sdpa full", "resident reuse", "resident blend@0.15 query", "resident blend@0.3 hkvd"):
        assert run[case]["s"] > 0, run[case]
    assert "assemble" in run["resident reuse"]["phases_ms"]
    assert report["exactness"]["torch.float32"]["blend@1 vs hf"]["top1"]
    assert report["decode"]["batch 2"]["step_ms"] > 0 and report["decode"]["own forward batch 1"]["step_ms"] > 0
    assert "hf sdpa full" in done.stdout and "JSON:" in done.stdout.splitlines()[-1]


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
    for row in result["batches"].values():
        assert row["eager"]["step_ms"] > 0 and row["graphs"]["step_ms"] > 0
        assert row["graphs_captured"] == 0 and row["graphs_fallback"].startswith("CUDA graph capture failed")
        assert row["same_tokens"]
