"""An agent trace on real text: prefill per turn for full prefill, prefix caching and blend, as a context
manager keeps, drops and reorders the agent's tool results.

The trace: a MuSiQue question is the task; the agent has one tool, `search`, and each turn calls it once and
gets one passage back as a tool result, a snippet of its first --result-words words (the question's own
passages, then the next questions' as noise).
Turn t's request is the system message, the task, and a (call, result) message pair per result the context
manager keeps, by its RULE:
    append   every result, in the order they came (an exact prefix from turn to turn)
    window   the last K results (--window): the oldest drops out and everything after it moves
    rerank   the window's results, the most relevant to the task first (all-MiniLM cosine, as retrieval ranks):
             each new result lands somewhere in the middle and everything after it moves
The request ends after the last kept message; the model answers with the next step (no retrieval).
MODES, each with a store of its own (what it stored at turn t is what it finds at t+1), run back to back per turn:
    full     every token computed (the reference)
    prefix   the longest exact prefix read from the store, the rest computed: vLLM's and SGLang's prefix caching
             (ragblend's mode prefix)
    blend    the exact prefix read, messages seen before at a new position read and blended at --ratio, new
             messages computed with the question (ragblend's default mode)
Per turn: prefill time (the plan, store reads, computes and the prefill: up to the first token's logits; wall
time, and this process's CPU time, steadier when other jobs share the cores: `cpu_ratios`) and
KL(full || mode), teacher-forced over full prefill's greedy answer (--answer-tokens). After each turn the
engine's own after-answer step stores what the next request may need; it runs after the answer is out, so it is
not prefill time, but it is reported (store_s).
Prints JSON (per rule: per-turn lists and totals, the ratios, commit and load average); saves a plot of prefill
time per turn for the three modes (--plot, default docs/agent_trace.png).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from app.cli.compare import agreement  # noqa: E402
from app.components import Components  # noqa: E402
from app.config import load_settings  # noqa: E402
from app.engine.query import QueryParams, QueryStats  # noqa: E402
from app.engine.rag_engine import RagEngine  # noqa: E402
from blend import SamplingParams, TextStream  # noqa: E402
from blend.driver import drain  # noqa: E402
from common import git_commit  # noqa: E402

RULES = ("append", "window", "rerank")
MODES = ("full", "prefix", "blend")
SYSTEM = "You are a research agent. Call search to find what the task needs, then answer it."
SEARCH = {"type": "function", "function": {"name": "search", "description": "Search the documents.",
                                           "parameters": {"type": "object", "properties": {
                                               "query": {"type": "string"}}, "required": ["query"]}}}


# ---- the trace ------------------------------------------------------------------------------------

def kept_results(rule: str, turn: int, window: int, relevance: list[float]) -> list[int]:
    """Which results (by arrival) the context manager keeps at `turn` (1-based: `turn` results have come)."""
    arrived = list(range(turn))
    if rule == "window":
        return arrived[-window:]
    if rule == "rerank":
        return sorted(arrived[-window:], key=lambda i: -relevance[i])
    return arrived


def clipped(passage: dict, words: int) -> dict:
    """A passage cut to its first `words` words (a search tool returns a snippet; 20 of them fit the context)."""
    return {"title": passage["title"], "text": " ".join(passage["text"].split()[:words])}


def trace(item: dict, results: list[dict], rule: str, window: int, relevance: list[float]) -> list[list[dict]]:
    """Each turn's messages."""
    def call(i: int) -> dict:
        arguments = json.dumps({"query": results[i]["title"]})
        return {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{i}", "type": "function", "function": {"name": "search", "arguments": arguments}}]}

    def result(i: int) -> dict:
        return {"role": "tool", "tool_call_id": f"call_{i}",
                "content": f"{results[i]['title']}\n{results[i]['text'].strip()}"}

    head = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Task: {item['question']}"}]
    return [head + [m for i in kept_results(rule, turn, window, relevance) for m in (call(i), result(i))]
            for turn in range(1, len(results) + 1)]


def relevance_to(parts: Components, task: str, results: list[dict]) -> list[float]:
    """Cosine of each result with the task (the retrieval embedder; its vectors are normalised)."""
    vectors = parts.embedder.embed([f"{r['title']}\n{r['text']}" for r in results])
    return [float(x) for x in vectors @ parts.embedder.embed_query(task)]


# ---- one turn ------------------------------------------------------------------------------------

def one_turn(engine: RagEngine, messages: list[dict], mode: str, ratio: float, answer_tokens: int
             ) -> tuple[Any, Any, QueryStats, dict[str, float]]:
    """The engine's own steps for one request: its plan and prefill (timed) and, unless full, its
    after-answer storing (timed apart). Returns (plan, prefill, stats, seconds)."""
    params = QueryParams("", messages=tuple(messages), tools=(SEARCH,), retrieve=False, mode=mode,
                         ratio=ratio if mode == "blend" else None, max_tokens=answer_tokens)
    stats, seconds = QueryStats(mode=mode), {}

    start, cpu = time.perf_counter(), time.process_time()
    plan, loaded = engine.plan(params, answer_tokens, stats)  # (off the model thread in the server)
    prefill = drain(engine.prefill(params, plan, loaded, stats))
    int(prefill.logits.argmax())  # the first token is chosen from these
    seconds["prefill_s"], seconds["cpu_s"] = time.perf_counter() - start, time.process_time() - cpu
    start = time.perf_counter()
    if mode != "full":  # the spans the store lacked, cut from the prefill (app.engine.planner): no compute
        engine.planner.store(plan, loaded, prefill)
    seconds["store_s"] = time.perf_counter() - start
    return plan, prefill, stats, seconds


def greedy(engine: RagEngine, prefill, tokens: int) -> list[int]:
    """Full prefill's greedy answer, decoded as serving decodes (the prefill's own cache left as it was)."""
    stream = TextStream(engine.parts.tokenizer, eos_ids=engine.parts.runtime.eos_ids)
    for _ in engine.parts.runtime.generate(prefill, SamplingParams(max_new_tokens=tokens), stream):
        pass
    return stream.ids


def engines(shared: Components, root: Path) -> dict[str, RagEngine]:
    """An engine per mode, each with a store (and database) of its own under `root`, all on `shared`'s model."""
    loaded = {name: getattr(shared, name) for name in ("llm", "blender", "runtime", "prompt", "embedder")}
    out = {}
    for mode in MODES:
        mode_settings = shared.settings.model_copy(update={"data_dir": root / mode})
        parts = Components(mode_settings)
        parts.__dict__.update(loaded)
        out[mode] = RagEngine(mode_settings, parts)
    return out


def run_rule(engines: dict[str, RagEngine], turns: list[list[dict]], rule: str, ratio: float, answer_tokens: int
             ) -> dict[str, Any]:
    """The trace, a turn at a time: full, prefix and blend back to back (so load drifts hit them alike)."""
    blender = engines["full"].parts.blender
    out: dict[str, Any] = {"prompt_tokens": [], "modes": {}}
    rows = {mode: {"prefill_s": [], "cpu_s": [], "store_s": [], "kl": [], "top1": [], "cached_tokens": [],
                   "exact_tokens": [], "recomputed_tokens": [], "computed_tokens": []} for mode in MODES}
    for t, messages in enumerate(turns):
        for mode in MODES:
            engine = engines[mode]
            plan, prefill, stats, seconds = one_turn(engine, messages, mode, ratio, answer_tokens)
            if mode == "full":
                answer = greedy(engine, prefill, answer_tokens)
                ref_logp = torch.log_softmax(blender.teacher_force(prefill, answer), -1)
                out["prompt_tokens"].append(stats.prompt_tokens)
            kl, top1 = (0.0, 1.0) if mode == "full" else agreement(
                ref_logp, torch.log_softmax(blender.teacher_force(prefill, answer), -1))
            computed = stats.prompt_tokens - stats.cached_tokens + stats.recomputed_tokens
            for name, value in (("prefill_s", seconds["prefill_s"]), ("cpu_s", seconds["cpu_s"]),
                                ("store_s", seconds["store_s"]), ("kl", kl),
                                ("top1", top1), ("cached_tokens", stats.cached_tokens),
                                ("exact_tokens", stats.exact_tokens), ("recomputed_tokens", stats.recomputed_tokens),
                                ("computed_tokens", computed)):
                rows[mode][name].append(round(value, 5) if isinstance(value, float) else value)
            print(f"{rule} turn {t + 1}/{len(turns)} {mode}: {stats.prompt_tokens} tokens, prefill "
                  f"{seconds['prefill_s']:.3f}s, {stats.cached_tokens} from the store ({stats.exact_tokens} exact, "
                  f"{stats.recomputed_tokens} recomputed), KL {kl:.4f}", file=sys.stderr)
    for mode, row in rows.items():
        row["total_prefill_s"] = round(sum(row["prefill_s"]), 4)
        row["total_cpu_s"] = round(sum(row["cpu_s"]), 4)
        row["total_store_s"] = round(sum(row["store_s"]), 4)
        row["mean_kl"] = round(float(np.mean(row["kl"])), 5)
        row["mean_top1"] = round(float(np.mean(row["top1"])), 4)
        out["modes"][mode] = row
    for key, unit in (("ratios", "total_prefill_s"), ("cpu_ratios", "total_cpu_s")):  # wall time; this process's CPU
        total = {mode: rows[mode][unit] for mode in MODES}
        out[key] = {"blend_vs_prefix": round(total["blend"] / total["prefix"], 4),
                    "blend_vs_full": round(total["blend"] / total["full"], 4),
                    "prefix_vs_full": round(total["prefix"] / total["full"], 4)}
    return out


def plot(runs: dict[str, dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 3.8), squeeze=False)
    for ax, (rule, run) in zip(axes[0], runs.items()):
        for mode, color in zip(MODES, ("black", "tab:orange", "tab:blue")):
            times = run["modes"][mode]["prefill_s"]
            ax.plot(range(1, len(times) + 1), times, "-o", color=color, markersize=3,
                    label=f"{mode} ({run['modes'][mode]['total_prefill_s']:.1f} s in all)")
        ax.set_title(f"{rule}: blend {run['ratios']['blend_vs_prefix']:.2f}x prefix, "
                     f"{run['ratios']['blend_vs_full']:.2f}x full", fontsize=10)
        ax.set_xlabel("turn")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("prefill (s)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", type=Path, default=REPO.parent / "shared/data/musique_dev.json")
    parser.add_argument("--question", type=int, default=0)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--rules", default=",".join(RULES))
    parser.add_argument("--window", type=int, default=8, help="results the window rule keeps")
    parser.add_argument("--ratio", type=float, default=0.15)
    parser.add_argument("--answer-tokens", type=int, default=8)
    parser.add_argument("--result-words", type=int, default=50, help="a tool result's words (a snippet)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--plot", type=Path, default=REPO / "docs" / "agent_trace.png")
    parser.add_argument("--combine", type=Path, nargs="+", help="instead of running: merge these runs' JSON "
                                                                  "(one rule each, run side by side) and plot them")
    args = parser.parse_args()
    if args.combine:
        reports = [json.loads(path.read_text()) for path in args.combine]
        combined = {**reports[0], "runs": {rule: run for r in reports for rule, run in r["runs"].items()},
                    "commits": sorted({r["commit"] for r in reports}),
                    "loadavg": {rule: [r["loadavg_before"], r["loadavg_after"]] for r in reports for rule in r["runs"]},
                    "plot": str(args.plot)}
        plot(combined["runs"], args.plot)
        print(json.dumps(combined, indent=2))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    dataset = json.loads(args.dataset.read_text())
    item = dataset[args.question]
    results = [clipped(c, args.result_words) for other in dataset[args.question:] for c in other["ctxs"]][:args.turns]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        settings = load_settings(data_dir=tmp, model={"cache_dir": str(REPO / "data/models")},
                                 limits={"max_prompt_tokens": 8000})
        shared, runs = Components(settings), {}
        relevance = relevance_to(shared, item["question"], results)
        for n, rule in enumerate(args.rules.split(",")):
            by_mode = engines(shared, Path(tmp) / rule)  # empty stores: each rule's trace starts from nothing
            try:
                if n == 0:  # warm-up, untimed
                    warm = trace(item, results[:1], "append", args.window, relevance)[0]
                    for mode, engine in by_mode.items():
                        one_turn(engine, warm, mode, args.ratio, args.answer_tokens)
                        engine.parts.close()
                    by_mode = engines(shared, Path(tmp) / f"{rule}-timed")
                runs[rule] = run_rule(by_mode, trace(item, results, rule, args.window, relevance), rule, args.ratio,
                                      args.answer_tokens)
            finally:
                for engine in by_mode.values():
                    engine.parts.close()
        parts = shared
    plot(runs, args.plot)
    print(json.dumps({"question": args.question, "turns": args.turns, "window": args.window, "ratio": args.ratio,
                      "result_words": args.result_words,
                      "answer_tokens": args.answer_tokens, "selection": parts.blender.selection,
                      "threads": torch.get_num_threads(), "fingerprint": parts.llm.fingerprint,
                      "commit": git_commit(), "loadavg_before": [round(x, 2) for x in load_before],
                      "loadavg_after": [round(x, 2) for x in os.getloadavg()], "plot": str(args.plot),
                      "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
