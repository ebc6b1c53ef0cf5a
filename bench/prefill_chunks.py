"""Chunked prefill: what a prefill slice costs, and what cutting layers into chunks costs the whole prefill.

    python bench/prefill_chunks.py [--tokens 4300] [--chunks none,1024,512,256,128] [--repeats 2]

The configured model computes a `--tokens` prompt in full (no KV read: every token runs every layer, as a long
chat the store has not seen does in the server) with Blender.chunk_tokens set to each of `--chunks` in turn
(interleaved per repeat, so load hits each alike). Per setting: the whole prefill's seconds (median), and its
longest and median slice (the work between two yields: what a short request sent meanwhile waits for at most,
a step's slices are whole chunks: app.serving.scheduler, server.step_token_budget). Prints JSON on stdout (with the
commit and the load average).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from app.components import Components  # noqa: E402
from app.config import load_settings  # noqa: E402
from common import git_commit  # noqa: E402


def slices(blender, ids: list[int]) -> list[float]:
    """Seconds of each slice of one full-compute prefill of `ids`."""
    steps, times = blender.prefill_steps([], ids, 1.0), []
    while True:
        start = time.perf_counter()
        try:
            next(steps)
        except StopIteration:
            return times
        times.append(time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4300)
    parser.add_argument("--chunks", default="none,1024,512,256,128")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    blender = Components(load_settings()).blender
    vocab = blender.model.config.vocab_size
    ids = [(i * 7919) % (vocab - 100) + 100 for i in range(args.tokens)]
    settings = [None if c == "none" else int(c) for c in args.chunks.split(",")]
    runs: dict[str, list[list[float]]] = {str(c): [] for c in settings}
    load_before = os.getloadavg()
    blender.chunk_tokens = settings[0]
    slices(blender, ids[:512])  # warm-up
    for repeat in range(args.repeats):
        for chunk in settings:
            blender.chunk_tokens = chunk
            runs[str(chunk)].append(slices(blender, ids))
            print(f"[bench/prefill_chunks] repeat {repeat + 1} chunk {chunk}: {sum(runs[str(chunk)][-1]):.2f}s",
                  file=sys.stderr, flush=True)
    result = {name: {"prefill_s": round(statistics.median(sum(r) for r in rs), 3),
                     "slices": len(rs[0]),
                     "slice_max_s": round(max(max(r) for r in rs), 3),
                     "slice_median_s": round(statistics.median(t for r in rs for t in r), 4)}
              for name, rs in runs.items()}
    print(json.dumps({"commit": git_commit(), "tokens": args.tokens, "layers": blender.num_layers,
                      "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "chunk_tokens": result},
                     indent=1))


if __name__ == "__main__":
    main()
