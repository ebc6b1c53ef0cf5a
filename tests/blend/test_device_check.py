"""bench/device_check.py's CPU smoke mode runs end to end on a tiny model and writes its JSON and table."""
from __future__ import annotations

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
