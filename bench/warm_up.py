"""The first request after /health turns 200, against the tenth (issue 55: target first <= 1.5x tenth).

    python bench/warm_up.py [--dataset ../shared/data/musique_dev.json] [--questions 10] [--passages 4]
                            [--warm-up on,off]

Ingests `--passages` MuSiQue passages of each of `--questions` questions through one `ragblend serve`, stops it,
then for each `--warm-up` setting starts a fresh server on that data dir (a restart, as in production), waits for
/health 200, and sends the questions one at a time as streaming chat completions on the RAG model id (retrieval,
the planner, a blended prefill of the stored passages, decode), each a different question. TTFT: send -> first
content delta, client side. Prints JSON on stdout (commit, load average, each setting's TTFTs, first / tenth).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.serve import free_port, ingest, start_server, wait_ready  # noqa: E402
from blend.model import EMBEDDED, served_name  # noqa: E402
from common import git_commit  # noqa: E402


def log(message: str) -> None:
    print(f"[bench/warm_up] {message}", file=sys.stderr, flush=True)


def ttft(url: str, question: str) -> float:
    body = {"model": served_name(EMBEDDED), "messages": [{"role": "user", "content": question}], "max_tokens": 4,
            "stream": True}
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=1200) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                delta = json.loads(line[5:])["choices"][0]["delta"]
                if delta.get("content"):
                    return time.perf_counter() - start
    raise RuntimeError("no content delta")


def serve(data_dir: str, warm_up: bool):
    port = free_port()
    os.environ["RAGBLEND_SERVER__WARM_UP"] = "true" if warm_up else "false"
    server = start_server(data_dir, port, max_batch=8, queue_size=16, threads=None)
    url = f"http://127.0.0.1:{port}"
    start = time.perf_counter()
    try:
        wait_ready(url, server, timeout=1800)
    except BaseException:
        server.terminate()
        raise
    return server, url, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", type=Path, default=REPO.parent / "shared" / "data" / "musique_dev.json")
    parser.add_argument("--questions", type=int, default=10)
    parser.add_argument("--passages", type=int, default=4)
    parser.add_argument("--warm-up", default="on,off", help="settings to run, in order: on, off or both")
    args = parser.parse_args()
    items = json.loads(args.dataset.read_text())[:args.questions]
    report = {"commit": git_commit(), "load_avg_start": os.getloadavg(), "questions": len(items), "runs": {}}
    with tempfile.TemporaryDirectory(prefix="ragblend-warm-up-") as data_dir:
        server, url, _ = serve(data_dir, warm_up=False)
        try:
            report["chunks"] = ingest(url, items, args.passages)
        finally:
            server.terminate()
            server.wait(60)
        for setting in args.warm_up.split(","):
            server, url, ready_s = serve(data_dir, warm_up=setting == "on")
            try:
                ttfts = []
                for i, item in enumerate(items):
                    ttfts.append(round(ttft(url, item["question"]), 3))
                    log(f"warm_up {setting}: request {i + 1}: TTFT {ttfts[-1]} s")
            finally:
                server.terminate()
                server.wait(60)
            report["runs"][setting] = {"ready_s": round(ready_s, 2), "ttft_s": ttfts, "first_s": ttfts[0],
                                       "last_s": ttfts[-1], "first_over_last": round(ttfts[0] / ttfts[-1], 2)}
    report["load_avg_end"] = os.getloadavg()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
