"""TTFT of full prefill vs full reuse vs blend, in one run, on MuSiQue passages.

Single run (default 5 passages, ~3k tokens) prints JSON:
    {"prompt_tokens", "full_s", "full_kernels_s", "ratios": {"full_kernels", "reuse", "blend@0.15", "blend@0.3"},
     "ratios_vs_full_kernels": {...}, "ttft_s", "phases_ms", ...}
Two baselines: `full`, HF's own forward (its sdpa attention: what a user would otherwise run), and
`full_kernels`, every token through every layer of the blend loop, with the same attention on the same device
as a blend (the backend's plan: the C kernel on the CPU, sdpa / FlexAttention on CUDA). A mode's ratio to
`full` is what ragblend buys; to `full_kernels`, what blending alone buys.
`--sweep` prints one JSON with such a run for 2, 5, 10 and 14 passages (a question has 10; the
next questions' passages fill up, and a prompt stops short of the model's context), modes
full / reuse / blend@0.15 / blend@0.3 / blend@1, plus the commit and the load average.
A mode is `reuse`, `blend@R` (the configured selection policy) or `POLICY@R` (e.g. `hkvd@0.15`).
TTFT = chunk KVs fetched from the store's memory tier + prefill + choosing the first token;
each ratio is mode TTFT / full-prefill TTFT, medians over interleaved repeats of one run;
phases are each mode's `PrefillStats.timings_ms` from its last repeat.
"""
from __future__ import annotations

import argparse
import json
import os
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
from common import git_commit  # noqa: E402

SWEEP_PASSAGES = (2, 5, 10, 14)
SWEEP_MODES = "reuse,blend@0.15,blend@0.3,blend@1"
ANSWER_ROOM = 64  # tokens left in the context for the answer


def measure(blender, kv_cache, item: dict, pool: list[dict], passages: int, modes: list[str], repeats: int) -> dict:
    """One interleaved run of `modes` (full first) on the first `passages` passages of `pool`."""
    limit = getattr(blender.model.config, "max_position_embeddings", None) or 1 << 30
    suffix = kv_cache.prompt.suffix_ids(item["question"])
    chosen, ids = [], kv_cache.head_ids + suffix
    for c in pool[:passages]:
        passage_ids = kv_cache.prompt.text_passage_ids(c["text"], c["title"])
        if len(ids) + len(passage_ids) + ANSWER_ROOM > limit:
            break
        kv_cache.ensure(passage_ids)  # precompute outside the timed region, as ingest does
        chosen.append(passage_ids)
        ids = ids[: -len(suffix)] + passage_ids + suffix

    def ttft(mode: str) -> tuple[float, float, dict]:
        start, cpu = time.perf_counter(), time.process_time()
        if mode == "full":
            prefill = blender.full_prefill(ids)
        elif mode == "full_kernels":
            prefill = blender.prefill([], ids, 1.0)
        else:
            segments = [kv_cache.head()] + [kv_cache.lookup_key(kv_cache.key(p), p)[0] for p in chosen]  # as read
            name, _, ratio = mode.partition("@")
            selection = None if name in ("reuse", "blend") else name
            prefill = blender.prefill(segments, suffix, float(ratio or 0), selection=selection)
        int(prefill.logits.argmax())
        return time.perf_counter() - start, time.process_time() - cpu, prefill.stats.timings_ms

    modes = ["full", "full_kernels", *modes]
    ttft("full")  # warm-up
    times: dict[str, list[float]] = {m: [] for m in modes}
    cpu_times: dict[str, list[float]] = {m: [] for m in modes}
    phases: dict[str, dict] = {}
    for r in range(repeats):
        for mode in modes:  # interleaved, so noise hits every mode alike
            seconds, cpu, phases[mode] = ttft(mode)
            times[mode].append(seconds)
            cpu_times[mode].append(cpu)
            print(f"{len(chosen)} passages, repeat {r + 1}/{repeats} {mode}: {seconds:.3f}s (cpu {cpu:.3f}s)",
                  file=sys.stderr)
    median = {m: statistics.median(t) for m, t in times.items()}
    cpu_median = {m: statistics.median(t) for m, t in cpu_times.items()}
    return {
        "passages": len(chosen),
        "prompt_tokens": len(ids),
        "full_s": round(median["full"], 4),
        "full_kernels_s": round(median["full_kernels"], 4),
        "ratios": {m: round(median[m] / median["full"], 4) for m in modes if m != "full"},
        "ratios_vs_full_kernels": {m: round(median[m] / median["full_kernels"], 4) for m in modes
                                   if m not in ("full", "full_kernels")},
        "ttft_s": {m: round(s, 4) for m, s in median.items()},
        # CPU seconds of this process: steadier than wall time when other jobs share the cores
        "cpu_ratios": {m: round(cpu_median[m] / cpu_median["full"], 4) for m in modes if m != "full"},
        "cpu_s": {m: round(s, 4) for m, s in cpu_median.items()},
        "phases_ms": phases,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", type=Path, default=REPO.parent / "shared/data/musique_dev.json")
    parser.add_argument("--question", type=int, default=0)
    parser.add_argument("--passages", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default=None, help="comma-separated, besides full (default: reuse,blend@0.15,"
                                                      f"blend@0.3; with --sweep {SWEEP_MODES})")
    parser.add_argument("--sweep", action="store_true", help=f"one run per passage count in {SWEEP_PASSAGES}")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = (args.modes or (SWEEP_MODES if args.sweep else "reuse,blend@0.15,blend@0.3")).split(",")

    dataset = json.loads(args.dataset.read_text())
    item = dataset[args.question]
    # The question's own passages (MuSiQue has 10), then the next questions' as distractors.
    pool = [c for other in dataset[args.question:] for c in other["ctxs"]]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        settings = load_settings(data_dir=tmp, model={"cache_dir": str(REPO / "data/models")})
        parts = Components(settings)
        try:
            counts = SWEEP_PASSAGES if args.sweep else (args.passages,)
            runs = [measure(parts.blender, parts.kv_cache, item, pool, n, modes, args.repeats) for n in counts]
        finally:
            parts.close()
    info = {"threads": torch.get_num_threads(), "fingerprint": parts.llm.fingerprint, "commit": git_commit(),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()]}
    if args.sweep:
        print(json.dumps({"question": args.question, "repeats": args.repeats, **info, "runs": runs}, indent=2))
    else:
        print(json.dumps({**runs[0], **info}, indent=2))


if __name__ == "__main__":
    main()
