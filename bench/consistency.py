"""How often an answer changes with the cache's state (issue 57): the same question answered with its passages'
KV blended from the store (what a warm cache gives) against computed in the prefill (what a cold cache, or Redis
down, gives), greedily, on MuSiQue.

    python bench/consistency.py [--dataset ../shared/data/musique_dev.json] [--limit 6] [--passages 5]
                                [--report reports/compare/report.json]

Runs `ragblend compare` (the default blend mode, blend.selection at blend.ratio, against full prefill; passages
through the store codec as serving reads them) into a temporary folder, or reads the report.json of an earlier
compare (`--report`), and prints JSON: for each blended mode, the share of questions whose greedy answer differs
from the computed one, how many of those moved answer F1 against the gold answers (and which way), and the pairs.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from app.config import load_settings  # noqa: E402
from common import git_commit  # noqa: E402

COMPUTED = "full"  # compare's reference mode: every passage computed in the prefill


def run_compare(dataset: Path, limit: int, passages: int, out: Path) -> Path:
    ratio = str(load_settings().blend.ratio)  # the default blend mode alone (compare adds hkvd and random)
    subprocess.run([sys.executable, "-m", "app.cli.main", "compare", "--dataset", str(dataset), "--limit", str(limit),
                    "--passages", str(passages), "--ratios", ratio, "--out", str(out)], cwd=REPO, check=True)
    return out / "report.json"


def summary(report: dict) -> dict:
    questions = report["questions"]
    modes = [m for m in report["modes"] if m != COMPUTED and not m.endswith("@1")]
    out = {}
    for mode in modes:
        rows = [(q["question"], q["modes"][COMPUTED], q["modes"][mode]) for q in questions if mode in q["modes"]]
        differ = [(question, full, blended) for question, full, blended in rows if not blended["same_answer"]]
        out[mode] = {"questions": len(rows), "answers_differ": len(differ),
                     "share_differ": round(len(differ) / len(rows), 3) if rows else None,
                     "f1_better": sum(b["f1"] > f["f1"] for _, f, b in differ),
                     "f1_worse": sum(b["f1"] < f["f1"] for _, f, b in differ),
                     "pairs": [{"question": q, "computed": f["answer"], "blended": b["answer"]} for q, f, b in differ]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", type=Path, default=REPO.parent / "shared" / "data" / "musique_dev.json")
    parser.add_argument("--limit", type=int, default=6)
    parser.add_argument("--passages", type=int, default=5)
    parser.add_argument("--report", type=Path, help="summarise this compare report.json instead of running one")
    args = parser.parse_args()
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ragblend-consistency-") as tmp:
        path = args.report or run_compare(args.dataset, args.limit, args.passages, Path(tmp))
        report = json.loads(path.read_text())
    print(json.dumps({"commit": git_commit(), "report_commit": report.get("commit"), "report": str(path),
                      "config": report["config"], "load_avg_start": load_start, "load_avg_end": os.getloadavg(),
                      "by_mode": summary(report)}, indent=2))


if __name__ == "__main__":
    main()
