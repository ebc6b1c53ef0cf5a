"""TTFT of full prefill vs full reuse vs blend, in one run, on 5 MuSiQue passages (~3k tokens).

Prints JSON: {"prompt_tokens", "full_s", "ratios": {"reuse", "blend@0.15", "blend@0.3"}, ...}.
A mode is `reuse`, `blend@R` (the configured selection policy) or `POLICY@R` (e.g. `hkvd@0.15`).
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

from app.components import build_kv_cache, load_llm, open_store  # noqa: E402
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
        loaded = load_llm(settings)
        store = open_store(settings, loaded.fingerprint)
        kv_cache = build_kv_cache(settings, loaded, store)
        blender, prompt = kv_cache.blender, kv_cache.prompt
        passages = [(c["text"], c["title"]) for c in item["ctxs"][: args.passages]]
        for text, title in passages:  # precompute outside the timed region, as ingest does
            kv_cache.ensure(text, title)
        suffix = prompt.suffix_ids(item["question"])
        ids = kv_cache.head_ids + [i for p in passages for i in kv_cache.passage_ids(*p)] + suffix

        def ttft(mode: str) -> tuple[float, dict]:
            start = time.perf_counter()
            if mode == "full":
                prefill = blender.full_prefill(ids)
            else:
                segments = [kv_cache.head()] + [kv_cache.get_or_compute(*p)[0] for p in passages]
                name, _, ratio = mode.partition("@")
                selection = None if name in ("reuse", "blend") else name
                prefill = blender.prefill(segments, suffix, float(ratio or 0), selection=selection)
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
        store.close()
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
