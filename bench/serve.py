"""Serving benchmark: TTFT and throughput of blend vs full prefill through the HTTP API.

    python bench/serve.py [--questions 6] [--passages 10] [--requests 8] [--top-k 4] [--max-tokens 8]
                          [--concurrency 1,4]

Starts `ragblend serve` as a subprocess on a free loopback port over a temporary data dir, with
one chunk per MuSiQue passage (chunks up to 1024 tokens, as in CacheBlend's setup), and ingests
the first questions' passages through POST /v1/documents. Then, for each concurrency level and
mode, it sends `--requests` streaming /v1/query requests (the questions, cycled) from that many
client threads. TTFT = time from sending a request to its first SSE delta, as the client sees it
(queue wait included: one worker serves every request); requests/s = requests / wall time.
Prints JSON on stdout, progress on stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
DATASET = REPO.parent / "shared" / "data" / "musique_dev.json"


def log(message: str) -> None:
    print(f"[bench/serve] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(data_dir: str, port: int, queue_size: int) -> subprocess.Popen:
    env = {**os.environ, "RAGBLEND_DATA_DIR": data_dir, "RAGBLEND_MODEL__CACHE_DIR": str(REPO / "data" / "models"),
           "RAGBLEND_SERVER__QUEUE_SIZE": str(queue_size), "RAGBLEND_CHUNKING__TARGET_TOKENS": "1024",
           "RAGBLEND_CHUNKING__MAX_TOKENS": "1024"}
    return subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
                            cwd=REPO, env=env)


def wait_ready(http: httpx.Client, server: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"server exited with {server.returncode}")
        try:
            if http.get("/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit("server not ready in time")


def ask(url: str, question: str, mode: str, top_k: int, max_tokens: int) -> dict:
    """One streaming query: client-side TTFT (first delta) and end-to-end seconds, plus server stats."""
    body = {"question": question, "mode": mode, "top_k": top_k, "max_tokens": max_tokens, "stream": True}
    start = time.perf_counter()
    ttft, result, event = None, None, None
    with httpx.stream("POST", f"{url}/v1/query", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                if ttft is None:
                    ttft = time.perf_counter() - start
                if event == "result":
                    result = json.loads(line[5:])
    return {"ttft_s": ttft, "e2e_s": time.perf_counter() - start, "stats": result["stats"]}


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))]


def run(url: str, questions: list[str], mode: str, concurrency: int, top_k: int, max_tokens: int) -> dict:
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda q: ask(url, q, mode, top_k, max_tokens), questions))
    wall = time.perf_counter() - start
    ttfts, e2e = [r["ttft_s"] for r in results], [r["e2e_s"] for r in results]
    stats = [r["stats"] for r in results]
    return {
        "requests": len(results),
        "ttft_p50_s": round(statistics.median(ttfts), 3),
        "ttft_p95_s": round(percentile(ttfts, 95), 3),
        "e2e_p50_s": round(statistics.median(e2e), 3),
        "requests_per_s": round(len(results) / wall, 3),
        "server_ttft_p50_ms": round(statistics.median(s["ttft_ms"] for s in stats), 1),  # without queue wait
        "server_phases_p50_ms": {phase: round(statistics.median(s[f"{phase}_ms"] for s in stats), 1)
                                 for phase in ("retrieve", "kv_load", "prefill")},
        "prompt_tokens_mean": round(statistics.mean(s["prompt_tokens"] for s in stats), 1),
        "cached_tokens_mean": round(statistics.mean(s["cached_tokens"] for s in stats), 1),
        "recomputed_tokens_mean": round(statistics.mean(s["recomputed_tokens"] for s in stats), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", type=Path, default=DATASET)
    parser.add_argument("--questions", type=int, default=6)
    parser.add_argument("--passages", type=int, default=10, help="per question")
    parser.add_argument("--requests", type=int, default=8, help="per mode and concurrency level")
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--concurrency", default="1,4")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    items = json.loads(args.dataset.read_text())[: args.questions]
    questions = [items[i % len(items)]["question"] for i in range(args.requests)]

    with tempfile.TemporaryDirectory(prefix="ragblend-bench-") as data_dir:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = start_server(data_dir, port, queue_size=max(levels) * 2)
        try:
            with httpx.Client(base_url=url, timeout=600) as http:
                t = time.perf_counter()
                wait_ready(http, server)
                log(f"server ready in {time.perf_counter() - t:.1f}s")

                # 1. The corpus: every passage of every question, one document each.
                t, chunks = time.perf_counter(), 0
                for i, item in enumerate(items):
                    for j, ctx in enumerate(item["ctxs"][: args.passages]):
                        doc = {"id": f"q{i}-p{j}", "title": ctx.get("title") or None, "text": ctx["text"]}
                        response = http.post("/v1/documents", json=doc)
                        response.raise_for_status()
                        chunks += response.json()["data"][0]["n_chunks"]
                    log(f"ingested question {i + 1}/{len(items)}'s passages ({chunks} chunks so far)")
                ingest_s = time.perf_counter() - t

                # 2. Warm-up (first-call costs), then every concurrency level, modes interleaved.
                for mode in ("blend", "full"):
                    ask(url, questions[0], mode, args.top_k, args.max_tokens)
                results: dict[str, dict[str, dict]] = {"blend": {}, "full": {}}
                for c in levels:
                    for mode in ("blend", "full"):
                        results[mode][f"c{c}"] = r = run(url, questions, mode, c, args.top_k, args.max_tokens)
                        log(f"{mode} c={c}: ttft p50 {r['ttft_p50_s']}s p95 {r['ttft_p95_s']}s, "
                            f"{r['requests_per_s']} req/s")
        finally:
            server.terminate()
            server.wait(30)

    print(json.dumps({
        "questions": len(items), "passages": sum(len(i["ctxs"][: args.passages]) for i in items),
        "chunks": chunks, "requests": args.requests,
        "ingest_s": round(ingest_s, 1), "top_k": args.top_k, "max_tokens": args.max_tokens,
        "results": results,
        "ttft_p50_speedup": {f"c{c}": round(results["full"][f"c{c}"]["ttft_p50_s"] /
                                            results["blend"][f"c{c}"]["ttft_p50_s"], 2) for c in levels},
    }, indent=2))


if __name__ == "__main__":
    main()
