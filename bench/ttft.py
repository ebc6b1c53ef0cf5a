"""TTFT of full prefill vs full reuse vs blend, in one run, on 5 MuSiQue passages (~3k tokens).

Prints JSON: {"prompt_tokens", "full_s", "ratios": {"reuse", "blend@0.15", "blend@0.3"}, ...}.
TTFT = chunk KVs fetched from the store's memory tier + prefill + choosing the first token;
each ratio is mode TTFT / full-prefill TTFT, medians over interleaved repeats of one run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from app.components import Components  # noqa: E402
from app.config import load_settings  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dataset", type=Path, default=REPO.parent / "shared/data/musique_dev.json")
    parser.add_argument("--question", type=int, default=0)
    parser.add_argument("--passages", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default="reuse,blend@0.15,blend@0.3")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    item = json.loads(args.dataset.read_text())[args.question]
    with tempfile.TemporaryDirectory() as tmp:
        settings = load_settings(data_dir=tmp, model={"cache_dir": str(REPO / "data/models")})
        parts = Components(settings)
        kv_cache, blender, prompt, loaded = parts.kv_cache, parts.blender, parts.prompt, parts.llm
        passages = [prompt.text_passage_ids(c["text"], c["title"]) for c in item["ctxs"][: args.passages]]
        for passage in passages:  # precompute outside the timed region, as ingest does
            kv_cache.ensure(passage)
        suffix = prompt.suffix_ids(item["question"])
        ids = kv_cache.head_ids + [i for p in passages for i in p] + suffix

        def ttft(mode: str) -> tuple[float, dict]:
            start = time.perf_counter()
            if mode == "full":
                prefill = blender.full_prefill(ids)
            else:
                segments = [kv_cache.head()] + [kv_cache.get_or_compute(p)[0] for p in passages]
                ratio = 0.0 if mode == "reuse" else float(mode.split("@")[1])
                prefill = blender.prefill(segments, suffix, ratio)
            int(prefill.logits.argmax())
            return time.perf_counter() - start, prefill.stats.timings_ms

        modes = ["full", *args.modes.split(",")]
        ttft("full")  # warm-up
        times: dict[str, list[float]] = {m: [] for m in modes}
        phases: dict[str, dict] = {}
        for r in range(args.repeats):
            for mode in modes:  # interleaved, so noise hits every mode alike
                seconds, phases[mode] = ttft(mode)
                times[mode].append(seconds)
                print(f"repeat {r + 1}/{args.repeats} {mode}: {seconds:.3f}s", file=sys.stderr)
        median = {m: statistics.median(t) for m, t in times.items()}
        parts.close()
    print(json.dumps({
        "prompt_tokens": len(ids),
        "full_s": round(median["full"], 4),
        "ratios": {m: round(median[m] / median["full"], 4) for m in modes if m != "full"},
        "ttft_s": {m: round(s, 4) for m, s in median.items()},
        "phases_ms": phases,
        "threads": torch.get_num_threads(),
        "fingerprint": loaded.fingerprint,
    }, indent=2))


if __name__ == "__main__":
    main()
