"""Detokenising an answer: host time per token at several answer lengths (blend.decode.TextStream).

    python bench/detokenize.py [--lengths 64,512,2000] [--repeats 5] [--stop "User:"]

The output side (app.engine.rag_engine.QueryOutput, on the event loop) turns each step's token ids into text
deltas: incremental, as vLLM's and HF's TextStreamer (only the tokens since the last complete piece are decoded),
so a token costs the same at any answer length. The answer is real text in the embedded model's tokenizer (an
English passage with multi-byte characters, repeated). An answer of each length is pushed a token at a time through
a TextStream with a stop string that never matches (its search and hold-back included); the timed tokens are the
answer's last 64, the same tokens at every length (so the text's mix of characters is the same): a token's cost
at that position. For contrast, the same tokens through a full re-decode of the answer at every token (what
TextStream did before, on the model thread). Per length: the median over repeats of the mean microseconds per
token; `spread` is the largest over the smallest incremental per-token time (the target: within ±10%). Prints
JSON on stdout (with the commit and the load average); lengths are interleaved per repeat, so load hits each
alike.
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
from app.config import load_settings  # noqa: E402
from blend import TextStream, load_model  # noqa: E402
from common import git_commit  # noqa: E402

TEXT = ("The river rises in the northern hills and runs south through three towns before it meets the sea; "
        "its name, naïve visitors are told, means « slow water » — 日本語では「ゆっくりした水」. ")


TIMED = 64  # the answer's last tokens, timed


def per_token_us(tokenizer, ids: list[int], stop: tuple[str, ...]) -> float:
    stream = TextStream(tokenizer, stop=stop, eos_ids=frozenset())
    for token in ids[:-TIMED]:
        stream.push(token)
    start = time.perf_counter()
    for token in ids[-TIMED:]:
        stream.push(token)
    return (time.perf_counter() - start) / TIMED * 1e6


def full_redecode_us(tokenizer, ids: list[int]) -> float:
    """The old way: the whole answer decoded again at every token."""
    start = time.perf_counter()
    for n in range(len(ids) - TIMED + 1, len(ids) + 1):
        tokenizer.decode(ids[:n], skip_special_tokens=True)
    return (time.perf_counter() - start) / TIMED * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="64,512,2000")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--stop", default="User:")
    parser.add_argument("--no-contrast", action="store_true", help="skip the full re-decode timing")
    args = parser.parse_args()
    settings = load_settings()
    tokenizer = load_model(settings.model.name, cache_dir=settings.model.cache_dir or settings.data_dir / "models",
                           device="cpu").tokenizer
    lengths = [int(n) for n in args.lengths.split(",")]
    base = tokenizer.encode(TEXT, add_special_tokens=False)
    filler = (base * (max(lengths) // len(base) + 1))
    tail = filler[:TIMED]
    answers = {n: filler[:n - TIMED] + tail for n in lengths}  # the same last tokens at every length
    load_before = os.getloadavg()
    per_token_us(tokenizer, answers[lengths[0]], (args.stop,))  # warm-up
    runs: dict[int, list[float]] = {n: [] for n in lengths}
    old: dict[int, list[float]] = {n: [] for n in lengths}
    for repeat in range(args.repeats):
        for n in lengths:
            runs[n].append(per_token_us(tokenizer, answers[n], (args.stop,)))
            if not args.no_contrast and repeat == 0:
                old[n].append(full_redecode_us(tokenizer, answers[n]))
    incremental = {n: round(statistics.median(runs[n]), 2) for n in lengths}
    result = {"bench": "detokenize", "commit": git_commit(REPO),
              "per_token_us": incremental,
              "spread": round(max(incremental.values()) / min(incremental.values()), 3),
              "full_redecode_per_token_us": {n: round(old[n][0], 2) for n in lengths if old[n]},
              "repeats": args.repeats, "load_avg_before": [round(x, 2) for x in load_before],
              "load_avg_after": [round(x, 2) for x in os.getloadavg()]}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
