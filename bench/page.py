"""What the page costs the API: /v1/query with `explain` off vs on, the page's files, Prefill.scores.

    python bench/page.py [--questions 4] [--passages 5] [--requests 6] [--top-k 4] [--max-tokens 8]

In-process (FastAPI's TestClient over one engine), over a temporary data dir holding the first
MuSiQue questions' passages. Requests alternate explain off / on with the same question, so both
see the same machine load; each reports the client's end-to-end time, the server's TTFT and the
response size (end-to-end times on a loaded machine are noisy: the decode dominates them).
`explain_build_ms` times building the explain part alone for a prompt of the mean size, and
`scores_fill_us` the one thing explain-off requests now do that they did not before: writing the
check layer's deviations into Prefill.scores. Prints JSON on stdout.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from fastapi.testclient import TestClient

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DATASET = REPO.parent / "shared" / "data" / "musique_dev.json"

from app.api.server import create_app  # noqa: E402
from app.config import load_settings  # noqa: E402
from app.engine.explain import explain_prompt  # noqa: E402
from blend import Prefill, PrefillStats  # noqa: E402


def median(values: list[float]) -> float:
    return round(statistics.median(values), 2)


def timed_query(client: TestClient, body: dict) -> dict:
    start = time.perf_counter()
    response = client.post("/v1/query", json=body)
    e2e_ms = (time.perf_counter() - start) * 1000
    response.raise_for_status()
    stats = response.json()["stats"]
    return {"e2e_ms": e2e_ms, "ttft_ms": stats["ttft_ms"], "prefill_ms": stats["prefill_ms"],
            "bytes": len(response.content), "prompt_tokens": stats["prompt_tokens"]}


def summary(runs: list[dict]) -> dict:
    return {key: median([r[key] for r in runs]) for key in ("e2e_ms", "ttft_ms", "prefill_ms", "bytes")}


def scores_fill_us(tokens: int, repeats: int = 2000) -> float:
    """Microseconds to build Prefill.scores for a prompt of `tokens` (as blend.blender does)."""
    deviation = torch.rand(tokens)
    start = time.perf_counter()
    for _ in range(repeats):
        scores = torch.full((tokens,), float("nan"))
        scores[10:tokens - 10] = deviation[: tokens - 20].float()
    return round((time.perf_counter() - start) / repeats * 1e6, 2)


def explain_build_ms(tokenizer, tokens: int, repeats: int = 10) -> float:
    """Milliseconds to build (and serialize) the explain part of a `tokens`-long prompt."""
    ids = torch.randint(100, 20000, (tokens,)).tolist()
    head, passages, question = ids[:20], [ids[20:tokens - 30]], ids[tokens - 30:]
    prefill = Prefill(None, None, tokens, torch.arange(20, tokens - 30, 7), PrefillStats(tokens, tokens - 30, 20),
                      torch.rand(tokens))
    start = time.perf_counter()
    for _ in range(repeats):
        explain_prompt(tokenizer, head, passages, question, prefill, score="s", max_tokens=4096).model_dump_json()
    return round((time.perf_counter() - start) / repeats * 1000, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", type=Path, default=DATASET)
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--passages", type=int, default=5)
    parser.add_argument("--requests", type=int, default=6, help="per setting")
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    items = json.loads(args.dataset.read_text())[: args.questions]

    with tempfile.TemporaryDirectory(prefix="ragblend-bench-") as data_dir:
        settings = load_settings(data_dir=data_dir, model={"cache_dir": str(REPO / "data" / "models")})
        with TestClient(create_app(settings)) as client:
            while client.get("/health").status_code != 200:
                time.sleep(0.5)
            for i, item in enumerate(items):
                for j, ctx in enumerate(item["ctxs"][: args.passages]):
                    doc = {"id": f"q{i}-p{j}", "title": ctx.get("title") or None, "text": ctx["text"]}
                    client.post("/v1/documents", json=doc).raise_for_status()
            print(f"[bench/page] ingested {args.questions * args.passages} passages", file=sys.stderr)

            runs: dict[str, list[dict]] = {"explain_off": [], "explain_on": []}
            for r in range(args.requests + 1):  # the first pair warms the store and the model
                body = {"question": items[r % len(items)]["question"], "top_k": args.top_k,
                        "max_tokens": args.max_tokens}
                off, on = timed_query(client, body), timed_query(client, {**body, "explain": True})
                if r:
                    runs["explain_off"].append(off)
                    runs["explain_on"].append(on)
            page_ms = []
            for _ in range(20):
                start = time.perf_counter()
                for path in ("/", "/static/app.js", "/static/style.css"):
                    client.get(path).raise_for_status()
                page_ms.append((time.perf_counter() - start) * 1000)
            tokens = round(statistics.mean(r["prompt_tokens"] for r in runs["explain_off"]))
            build_ms = explain_build_ms(client.app.state.service.engine.parts.tokenizer, tokens)
    print(json.dumps({
        "requests_per_setting": args.requests, "top_k": args.top_k, "max_tokens": args.max_tokens,
        "prompt_tokens_mean": tokens,
        **{name: summary(rs) for name, rs in runs.items()},
        "page_files_ms_p50": median(page_ms),
        "explain_build_ms": build_ms,
        "scores_fill_us": scores_fill_us(tokens),
    }, indent=2))


if __name__ == "__main__":
    main()
