"""Two real processes on one disk tier directory at once: one byte cap, whole reads, one set of stats."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from store import DiskTier

WORKER = Path(__file__).with_name("disk_worker.py")


def test_two_processes_share_one_disk_tier(tmp_path):
    root, sync = tmp_path / "kv", tmp_path / "sync"
    sync.mkdir()
    cap = 200_000  # about nine of the workers' values: both keep evicting each other's
    DiskTier(root, cap)  # create the index first, as the server would before `ragblend ingest` starts
    workers = [subprocess.Popen([sys.executable, str(WORKER), str(root), str(cap), str(seed), "400", str(sync)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for seed in (1, 2)]
    results = []
    for proc in workers:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        results.append(json.loads(out))

    first, second = (r["seen"] for r in results)
    assert first["start"] < second["end"] and second["start"] < first["end"]  # they ran at the same time
    one, two = (r["stats"] for r in results)
    for stats in (one, two):
        assert stats["errors"] == 0 and 0 < stats["bytes"] <= cap
    # Both processes, and the directory itself, agree on what the tier holds.
    assert (one["entries"], one["bytes"], one["evictions"]) == (two["entries"], two["bytes"], two["evictions"])
    files = list(root.rglob("*.val"))
    assert len(files) == one["entries"] and sum(f.stat().st_size for f in files) == one["bytes"]
    assert one["evictions"] > 0 and all(r["seen"]["hits"] and r["seen"]["range_hits"] for r in results)
    fresh = DiskTier(root, cap).stats()
    assert (fresh["entries"], fresh["bytes"], fresh["evictions"]) == (one["entries"], one["bytes"], one["evictions"])
