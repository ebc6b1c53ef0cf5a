"""Serving benchmark: concurrent streams through the HTTP API, batched scheduler vs one at a time.

    python bench/serve.py [--questions 6] [--passages 10] [--top-k 4] [--max-tokens 48]
                          [--concurrency 1,2,4,8] [--requests-per-stream 1] [--threads N]

Starts two `ragblend serve` processes on one temporary data dir: the scheduler as configured
(`server.max_batch: 8`) and the one-at-a-time baseline (`server.max_batch: 1`: one request on the model
thread at a time, the old worker's behaviour). Ingests one document per MuSiQue passage (chunks up to
1024 tokens, as in CacheBlend's setup) through the first; the second reads the same index and KV.
Then, for each concurrency level c, mode (blend, full) and server, interleaved: c client threads each
send `--requests-per-stream` streaming /v1/query requests (at least 2 requests per run) with
`ignore_eos`, so every answer is `--max-tokens` long and throughput compares like with like.

Per run: TTFT p50/p95 (client-side, send → first SSE delta, queue wait included), time between tokens
p50/p95 (gaps between deltas), output tokens/s overall (all completion tokens / wall time), and the server's
own mean decode step by rows decoded together (from /metrics: what the model thread spent in the steps, apart
from the gaps between them).
Prints JSON on stdout (with the commit and the load average), progress on stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from common import git_commit  # noqa: E402

DATASET = REPO.parent / "shared" / "data" / "musique_dev.json"
SERVERS = {"batched": 8, "one_at_a_time": 1}  # server.max_batch


def log(message: str) -> None:
    print(f"[bench/serve] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(data_dir: str, port: int, max_batch: int, queue_size: int, threads: int | None) -> subprocess.Popen:
    env = {**os.environ, "RAGBLEND_DATA_DIR": data_dir, "RAGBLEND_MODEL__CACHE_DIR": str(REPO / "data" / "models"),
           "RAGBLEND_SERVER__QUEUE_SIZE": str(queue_size), "RAGBLEND_SERVER__MAX_BATCH": str(max_batch),
           "RAGBLEND_CHUNKING__TARGET_TOKENS": "1024", "RAGBLEND_CHUNKING__MAX_TOKENS": "1024",
           "RAGBLEND_LIMITS__MAX_NEW_TOKENS": "1024",
           "RAGBLEND_SERVER__REQUEST_TIMEOUT_S": "3600"}  # a client here waits out the queue, however long
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return subprocess.Popen([sys.executable, "-m", "app.cli.main", "serve", "--host", "127.0.0.1", "--port", str(port)],
                            cwd=REPO, env=env)


@contextmanager
def served(max_batch: int = 8, queue_size: int = 16) -> Iterator[str]:
    """One `ragblend serve` on a temporary data dir, ready: its URL (the server terminated on exit)."""
    with tempfile.TemporaryDirectory() as data_dir:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = start_server(data_dir, port, max_batch, queue_size, threads=None)
        try:
            wait_ready(url, server)
            yield url
        finally:
            server.terminate()
            server.wait(60)


@contextmanager
def served_with(variables: dict[str, str]) -> Iterator[str]:
    """One `ragblend serve` with these RAGBLEND_* variables over the defaults, on a temporary data dir, ready: its
    URL (the server terminated on exit)."""
    with tempfile.TemporaryDirectory() as data_dir:
        env = {**os.environ, "RAGBLEND_DATA_DIR": data_dir, "RAGBLEND_MODEL__CACHE_DIR": str(REPO / "data" / "models"),
               **variables}
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = subprocess.Popen([sys.executable, "-m", "app.cli.main", "serve", "--host", "127.0.0.1", "--port",
                                   str(port)], cwd=REPO, env=env)
        try:
            wait_ready(url, server, timeout=3600)
            yield url
        finally:
            server.terminate()
            server.wait(60)


def wait_ready(url: str, server: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"server exited with {server.returncode}")
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit("server not ready in time")


def ask(url: str, question: str, mode: str, top_k: int, max_tokens: int) -> dict:
    """One streaming query: client-side TTFT, the gaps between deltas, and the server's stats."""
    body = {"question": question, "mode": mode, "top_k": top_k, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}
    start = time.perf_counter()
    arrivals, result, event = [], None, None
    with httpx.stream("POST", f"{url}/v1/query", json=body, timeout=1200) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                if event == "delta":
                    arrivals.append(time.perf_counter())
                elif event == "result":
                    result = json.loads(line[5:])
    return {"ttft_s": arrivals[0] - start, "gaps_s": [b - a for a, b in zip(arrivals, arrivals[1:])],
            "end": time.perf_counter(), "start": start, "stats": result["stats"]}


def step_totals(url: str) -> tuple[Counter, Counter]:
    """/metrics' batched decode steps by rows decoded together, and the seconds spent in them."""
    text = httpx.get(f"{url}/metrics").text
    return tuple(Counter({int(rows): float(value) for rows, value in
                          re.findall(rf'^ragblend:{name}_total{{rows="(\d+)"}} (\S+)$', text, re.MULTILINE)})
                 for name in ("decode_steps", "decode_step_seconds"))


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))]


def run(url: str, questions: list[str], mode: str, streams: int, per_stream: int, top_k: int,
        max_tokens: int) -> dict:
    """`streams` client threads, each sending its share of the requests one after another."""
    asked = [questions[i % len(questions)] for i in range(max(2, streams * per_stream))]
    shares = [asked[s::streams] for s in range(streams)]
    steps_before, seconds_before = step_totals(url)
    start = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        per_thread = list(pool.map(lambda share: [ask(url, q, mode, top_k, max_tokens) for q in share], shares))
    wall = time.perf_counter() - start
    steps_after, seconds_after = step_totals(url)
    steps, seconds = steps_after - steps_before, seconds_after - seconds_before  # this run's (positive) counts
    results = [r for thread in per_thread for r in thread]
    ttfts, gaps = [r["ttft_s"] for r in results], [g for r in results for g in r["gaps_s"]]
    tokens = sum(r["stats"]["completion_tokens"] for r in results)
    return {
        "requests": len(results),
        "ttft_p50_s": round(statistics.median(ttfts), 3),
        "ttft_p95_s": round(percentile(ttfts, 95), 3),
        "tbt_p50_ms": round(statistics.median(gaps) * 1000, 1) if gaps else None,
        "tbt_p95_ms": round(percentile(gaps, 95) * 1000, 1) if gaps else None,
        "output_tokens_per_s": round(tokens / wall, 2),
        "wall_s": round(wall, 1),
        "server_prefill_p50_ms": round(statistics.median(r["stats"]["prefill_ms"] for r in results), 1),
        "prompt_tokens_mean": round(statistics.mean(r["stats"]["prompt_tokens"] for r in results), 1),
        "server_step_ms_by_rows": {rows: round(seconds[rows] / n * 1000, 1) for rows, n in sorted(steps.items())},
        "server_steps_by_rows": {rows: int(n) for rows, n in sorted(steps.items())},
    }


def ingest(url: str, items: list[dict], passages: int) -> int:
    chunks = 0
    with httpx.Client(base_url=url, timeout=1200) as http:
        for i, item in enumerate(items):
            for j, ctx in enumerate(item["ctxs"][:passages]):
                doc = {"id": f"q{i}-p{j}", "title": ctx.get("title") or None, "text": ctx["text"]}
                response = http.post("/v1/documents", json=doc)
                response.raise_for_status()
                chunks += response.json()["data"][0]["n_chunks"]
            log(f"ingested question {i + 1}/{len(items)}'s passages ({chunks} chunks so far)")
    return chunks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", type=Path, default=DATASET)
    parser.add_argument("--questions", type=int, default=6)
    parser.add_argument("--passages", type=int, default=10, help="per question")
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--concurrency", default="1,2,4,8")
    parser.add_argument("--requests-per-stream", type=int, default=1)
    parser.add_argument("--modes", default="blend,full")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the servers")
    args = parser.parse_args()
    levels, modes = [int(c) for c in args.concurrency.split(",")], args.modes.split(",")
    items = json.loads(args.dataset.read_text())[: args.questions]
    questions = [item["question"] for item in items]
    load_before = os.getloadavg()

    with tempfile.TemporaryDirectory(prefix="ragblend-bench-") as data_dir:
        urls, servers = {}, {}
        try:
            for name, max_batch in SERVERS.items():
                port = free_port()
                urls[name] = f"http://127.0.0.1:{port}"
                servers[name] = start_server(data_dir, port, max_batch, queue_size=max(levels) * 2,
                                             threads=args.threads)
                t = time.perf_counter()
                wait_ready(urls[name], servers[name])
                log(f"{name} server ready in {time.perf_counter() - t:.1f}s")
                if name == "batched":  # 1. the corpus, through the first server (the second shares the dir)
                    t = time.perf_counter()
                    chunks = ingest(urls[name], items, args.passages)
                    ingest_s = time.perf_counter() - t

            # 2. Warm-up (first-call costs; the second server's memory tier), then every level, interleaved.
            for url in urls.values():
                for mode in modes:
                    for question in questions:
                        ask(url, question, mode, args.top_k, 2)
            results: dict[str, dict[str, dict[str, dict]]] = {s: {m: {} for m in modes} for s in SERVERS}
            for c in levels:
                for mode in modes:
                    for name, url in urls.items():
                        r = run(url, questions, mode, c, args.requests_per_stream, args.top_k, args.max_tokens)
                        results[name][mode][f"c{c}"] = r
                        log(f"{name} {mode} c={c}: ttft p50 {r['ttft_p50_s']}s p95 {r['ttft_p95_s']}s, "
                            f"tbt p50 {r['tbt_p50_ms']}ms p95 {r['tbt_p95_ms']}ms, {r['output_tokens_per_s']} tok/s")
        finally:
            for server in servers.values():
                server.terminate()
            for server in servers.values():
                server.wait(60)

    batched, single = results["batched"], results["one_at_a_time"]
    print(json.dumps({
        "commit": git_commit(), "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "questions": len(items), "passages": sum(len(i["ctxs"][: args.passages]) for i in items),
        "chunks": chunks, "ingest_s": round(ingest_s, 1), "top_k": args.top_k, "max_tokens": args.max_tokens,
        "requests_per_stream": args.requests_per_stream, "results": results,
        "throughput_vs_one_at_a_time": {mode: {f"c{c}": round(batched[mode][f"c{c}"]["output_tokens_per_s"] /
                                                              single[mode][f"c{c}"]["output_tokens_per_s"], 2)
                                               for c in levels} for mode in modes},
        "blend_ttft_p50_over_full": {name: {f"c{c}": round(results[name]["blend"][f"c{c}"]["ttft_p50_s"] /
                                                           results[name]["full"][f"c{c}"]["ttft_p50_s"], 3)
                                            for c in levels} for name in SERVERS}
        if {"blend", "full"} <= set(modes) else None,
    }, indent=2))


if __name__ == "__main__":
    main()
