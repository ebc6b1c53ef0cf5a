"""A prompt computed answers as its repeat: whether a chat's first answer (its spans computed in the prefill) and
the same chat again (those spans read back from the store, only the question computed) agree, and what attending
to the store's round trip in the first prefill costs.

    python bench/repeat.py [--chats 12] [--tokens 24] [--cost-runs 10]

`consistency`, per setting, over --chats chats (a system message and a question each, greedy, --tokens tokens,
each chat asked twice): how many answers the repeat gave the same, and the first token's |logprob difference|
(max, mean). Settings: `round_trip` (the default: the prefill attends to the spans the store will keep as their
codec round trip, blend.cache.StoredSpans), `as_computed` (it attends to them as computed, as before), and `native`
(a store that keeps KV unrounded: the reference, where only matmul rounding differs).
`cost`: a chat whose one message holds 5 MuSiQue passages (~3.1k tokens), prefilled with everything computed (each
run another tenant, so nothing is reused), the round trip on and off alternating: prefill ms, medians.
Prints JSON; the load average before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from app.components import Components  # noqa: E402
from app.config import load_settings  # noqa: E402
from app.engine.query import QueryParams  # noqa: E402
from app.engine.rag_engine import RagEngine  # noqa: E402
from common import git_commit  # noqa: E402

QUESTIONS = ["Name three colours.", "What is the capital of France?", "Write a haiku about rain.",
             "Give me two tips for sleeping well.", "What is 12 times 7?", "Describe a cat in one sentence.",
             "List three fruits.", "Who wrote Hamlet?", "Explain photosynthesis briefly.", "What does a compiler do?",
             "Suggest a name for a dog.", "Why is the sky blue?"]
DATASET = REPO.parent / "shared" / "data" / "musique_dev.json"


def log(message: str) -> None:
    print(f"[bench/repeat] {message}", file=sys.stderr, flush=True)


def engine(codec: str) -> RagEngine:
    settings = load_settings(data_dir=tempfile.mkdtemp(prefix="ragblend-repeat-"),
                             model={"cache_dir": str(REPO / "data" / "models")}, store={"codec": codec})
    return RagEngine(settings, Components(settings))


def first_logprob(rag: RagEngine, params: QueryParams) -> tuple[str, float]:
    result = list(rag.stream(params))[-1]
    return result.answer, result.logprobs[0].logprob


def consistency(rag: RagEngine, chats: int, tokens: int, setting: str) -> dict:
    same, gaps = 0, []
    for i in range(chats):
        messages = ({"role": "system", "content": f"Session {setting}-{i}."},
                    {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]})
        params = QueryParams(messages[-1]["content"], messages=messages, retrieve=False, max_tokens=tokens,
                             top_logprobs=0)
        (first, a), (again, b) = first_logprob(rag, params), first_logprob(rag, params)
        same += first == again
        gaps.append(abs(a - b))
    log(f"{setting}: {same}/{chats} the same, max |dlogprob| {max(gaps):.2e}")
    return {"same": same, "of": chats, "max_logprob_gap": max(gaps), "mean_logprob_gap": statistics.mean(gaps)}


def cost(rag: RagEngine, runs: int) -> dict:
    item = json.loads(DATASET.read_text())[40]
    text = "\n\n".join(f"Document [{j + 1}] (Title: {c['title']}): {c['text']}" for j, c in enumerate(item["ctxs"][:5]))
    message = {"role": "user", "content": f"{text}\n\nQuestion: {item['question']}"}
    round_trip, times = rag.parts.stored_round_trip, {"round_trip": [], "as_computed": []}
    for i in range(runs):
        setting = "round_trip" if i % 2 == 0 else "as_computed"
        rag.parts.__dict__["stored_round_trip"] = round_trip if setting == "round_trip" else None
        params = QueryParams(item["question"], messages=(message,), retrieve=False, max_tokens=1, tenant=f"run{i}")
        stats = list(rag.stream(params))[-1].stats
        times[setting].append(stats.prefill_ms)
        log(f"cost {setting}: {stats.prefill_ms:.0f} ms, {stats.prompt_tokens} tokens, {stats.cached_tokens} read")
    rag.parts.__dict__["stored_round_trip"] = round_trip
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {"prompt_tokens": stats.prompt_tokens, "prefill_ms_median": medians, "runs": times,
            "ratio": medians["round_trip"] / medians["as_computed"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chats", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--cost-runs", type=int, default=10)
    args = parser.parse_args()
    out = {"commit": git_commit(REPO), "loadavg_before": os.getloadavg()}
    rag = engine("int8")
    out["consistency"] = {"round_trip": consistency(rag, args.chats, args.tokens, "round_trip")}
    round_trip = rag.parts.stored_round_trip
    rag.parts.__dict__["stored_round_trip"] = None
    out["consistency"]["as_computed"] = consistency(rag, args.chats, args.tokens, "as_computed")
    rag.parts.__dict__["stored_round_trip"] = round_trip
    out["consistency"]["native"] = consistency(engine("native"), args.chats, args.tokens, "native")
    out["cost"] = cost(rag, args.cost_runs) if args.cost_runs else None
    out["loadavg_after"] = os.getloadavg()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
