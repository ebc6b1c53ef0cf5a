"""Fairness benchmark: the TTFT of a short query sent during a long chat's prefill, against the same query alone.

    python bench/fairness.py [--messages 40] [--words 80] [--delay 1.0] [--chunk-tokens N]

Starts one `ragblend serve` on a temporary data dir (no documents: both requests run with `retrieval: false`,
so the prompts are the chats alone). The short request: one user message, `max_tokens` 4, streamed; its TTFT
is client-side, send -> first delta. Alone (after a warm-up), then sent `--delay` s after a chat of
`--messages` messages of about `--words` words each (`max_tokens` 4) started. Prints JSON on stdout (the
commit, the load average, both TTFTs and their ratio, the long chat's own TTFT and total, and which request's
first token came first), progress on stderr. `--chunk-tokens` sets the server's server.prefill_chunk_tokens
(a prefill slice: one layer over at most that many tokens; a number past the prompt's length: whole layers,
as before chunked prefill).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.serve import served  # noqa: E402
from common import git_commit  # noqa: E402

WORDS = ("the harbour lamp keeper wrote down every ship that passed the rocks at night and the weather that came "
         "with it in a ledger kept on the desk by the window").split()


def log(message: str) -> None:
    print(f"[bench/fairness] {message}", file=sys.stderr, flush=True)


def chat(url: str, messages: list[dict], firsts: list[str], name: str) -> dict:
    """One streamed chat (max_tokens 4): client-side TTFT and total; `name` goes to `firsts` at its first delta."""
    body = {"messages": messages, "max_tokens": 4, "retrieval": False, "stream": True}
    start, first = time.perf_counter(), None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=3600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if first is None and line.startswith("data:") and '"content"' in line:
                first = time.perf_counter()
                firsts.append(name)
    return {"ttft_s": round(first - start, 3), "total_s": round(time.perf_counter() - start, 3)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=40)
    parser.add_argument("--words", type=int, default=80)
    parser.add_argument("--delay", type=float, default=1.0)
    parser.add_argument("--chunk-tokens", type=int, default=None, help="server.prefill_chunk_tokens (default: the "
                        "config's)")
    args = parser.parse_args()
    if args.chunk_tokens is not None:
        os.environ["RAGBLEND_SERVER__PREFILL_CHUNK_TOKENS"] = str(args.chunk_tokens)
    text = lambda i: " ".join(WORDS[(i + j) % len(WORDS)] for j in range(args.words))  # noqa: E731
    long = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"Note {i}: {text(i)}"}
            for i in range(args.messages - 1)] + [{"role": "user", "content": "Which ship came last?"}]
    short = [{"role": "user", "content": "Who keeps the lamp?"}]
    with served() as url:
        chat(url, short, [], "warm-up")
        alone = chat(url, short, [], "short")
        log(f"alone: {alone}")
        firsts: list[str] = []
        results: dict[str, dict] = {}
        thread = threading.Thread(target=lambda: results.update(long=chat(url, long, firsts, "long")))
        thread.start()
        time.sleep(args.delay)
        results["short"] = chat(url, short, firsts, "short")
        thread.join()
        log(f"during: {results}")
    print(json.dumps({"commit": git_commit(), "loadavg": os.getloadavg(), "chunk_tokens": args.chunk_tokens,
                      "messages": args.messages,
                      "words_per_message": args.words, "delay_s": args.delay, "short_alone": alone,
                      "short_during_long": results["short"], "long": results["long"], "first_token_order": firsts,
                      "ttft_ratio": round(results["short"]["ttft_s"] / alone["ttft_s"], 2)}, indent=1))


if __name__ == "__main__":
    main()
