"""Stuffed prompts sent together (issue #57): N chats of about T tokens each (MuSiQue passages pasted into one user
message, retrieval off) sent at once to a real `ragblend serve`, then each again once all have answered.

    python bench/burst.py [--chats 3] [--tokens 7300] [--write-queue-bytes N] [--dataset PATH]

Their spans reach the store's writer together; its queue is bounded in chunks and bytes (store.write_queue,
store.write_queue_bytes), and a full one refuses, the planner then handing over no more of that prompt. Per repeat:
the share of its prompt read from the store (cached_tokens / prompt_tokens; the target: >= 0.9 each), and from the
server's /metrics the chunks the writer refused by bound (`ragblend:kv_store_dropped_puts_total`: why a repeat
found less). Prints JSON on stdout (with the commit and the load average), progress on stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.serve import served_with  # noqa: E402
from common import git_commit  # noqa: E402

DATASET = REPO.parent / "shared" / "data" / "musique_dev.json"


def log(message: str) -> None:
    print(f"[bench/burst] {message}", file=sys.stderr, flush=True)


def prompts(dataset: list[dict], chats: int, tokens: int) -> list[str]:
    """`chats` stuffed prompts of about `tokens` tokens each (3.6 characters a SmolLM2 token in MuSiQue prose), no
    passage in two of them."""
    passages = iter(ctx for item in dataset for ctx in item["ctxs"])
    out = []
    for n in range(chats):
        docs: list[str] = []
        while sum(map(len, docs)) < 3.6 * tokens:
            ctx = next(passages)
            docs.append(f"Document [{len(docs) + 1}] (Title: {ctx['title']}): {ctx['text']}")
        out.append("Use the following documents to answer the question.\n\n" + "\n\n".join(docs)
                   + f"\n\nQuestion: {dataset[n]['question']}")
    return out


def metric(text: str, name: str) -> dict[str, float]:
    """A metric's samples in Prometheus text, by their labels."""
    return {line.split(" ")[0].removeprefix(name): float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(name)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=7300)
    parser.add_argument("--write-queue-bytes", type=int, default=None, help="store.write_queue_bytes (default: "
                                                                             "the config's)")
    parser.add_argument("--dataset", type=Path, default=DATASET)
    args = parser.parse_args()
    texts = prompts(json.loads(args.dataset.read_text()), args.chats, args.tokens)
    load_before = os.getloadavg()
    variables = {"RAGBLEND_LIMITS__MAX_MESSAGE_TOKENS": "8000", "RAGBLEND_LIMITS__MAX_PROMPT_TOKENS": "8000",
                 "RAGBLEND_LIMITS__MAX_QUESTION_CHARS": "200000", "RAGBLEND_SERVER__REQUEST_TIMEOUT_S": "3600",
                 **({"RAGBLEND_STORE__WRITE_QUEUE_BYTES": str(args.write_queue_bytes)}
                    if args.write_queue_bytes else {})}
    with served_with(variables) as url:

        def ask(text: str) -> dict:
            start = time.perf_counter()
            body = {"messages": [{"role": "user", "content": text}], "max_tokens": 2, "retrieval": False}
            usage = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=3600).raise_for_status().json()
            usage = usage["usage"]
            return {"prompt_tokens": usage["prompt_tokens"],
                    "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                    "seconds": round(time.perf_counter() - start, 2)}
        with ThreadPoolExecutor(args.chats) as pool:
            log(f"{args.chats} chats of ~{args.tokens} tokens at once")
            first = list(pool.map(ask, texts))
            log("each again")
            again = list(pool.map(ask, texts))
        metrics = httpx.get(f"{url}/metrics").text
    shares = [round(r["cached_tokens"] / r["prompt_tokens"], 4) for r in again]
    print(json.dumps({"bench": "burst", "commit": git_commit(), "load_avg_before": load_before,
                      "load_avg_after": os.getloadavg(), "chats": args.chats, "tokens": args.tokens,
                      "write_queue_bytes": args.write_queue_bytes, "first": first, "repeat": again,
                      "repeat_cached_share": shares, "target_met": min(shares) >= 0.9,
                      "dropped_puts": metric(metrics, "ragblend:kv_store_dropped_puts_total"),
                      "dropped_put_bytes": metric(metrics, "ragblend:kv_store_dropped_put_bytes_total")}, indent=2))


if __name__ == "__main__":
    main()
