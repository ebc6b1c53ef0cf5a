"""An upload during maximal /v1/embeddings calls (issue #57): N such calls sent at once to a real `ragblend serve`
(default settings, a temporary data dir), one small document uploaded `--delay` seconds after the ingest lane
starts on their first slice (seen in /health; before that each call is being priced, and the lane is free).

    python bench/embed_lane.py [--calls 8] [--delay 1.0] [--tenants 1] [--dataset PATH]

A maximal call is the most a request may hold: /v1/embeddings' MAX_INPUTS texts (256), each as long as the price
bound lets it be (limits.max_embedding_tokens over the texts, less limits.piece_cost_tokens a text, at most the
embedder's window), of MuSiQue passages run together and cut at a word's end, so the server counts what this does.
Embeddings run on the ingest lane a slice (embedder.batch_size texts) a job, taking turns with uploads. A tenant's
calls in flight are bounded together (limits.max_tenant_embedding_tokens: a 429 past it), so with one tenant (the
default settings) only two are in flight; `--tenants N` spreads the calls over N API keys (server.api_keys), each
with a budget of its own, to fill the lane. Measured: the upload's HTTP status and seconds (the target: a 201
within 10 s) and how long of that it waited for the lane (/health), each call's status and seconds, and the same
kind of upload's seconds alone on the idle server (after one warm-up upload). Prints JSON on stdout (with the
commit and the load average), progress on stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import count, cycle
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from app.api.openai_embeddings import MAX_INPUTS  # noqa: E402
from app.config import load_settings  # noqa: E402
from bench.serve import served_with  # noqa: E402
from common import git_commit  # noqa: E402
from retrieval.embedder import embedded_model_path, embedder_name  # noqa: E402

DATASET = REPO.parent / "shared" / "data" / "musique_dev.json"
TARGET_S = 10.0


def log(message: str) -> None:
    print(f"[bench/embed_lane] {message}", file=sys.stderr, flush=True)


def maximal_inputs(passages: list[str], calls: int) -> tuple[list[list[str]], int]:
    """`calls` lists of MAX_INPUTS texts, each of at most the pieces a maximal request allows; and that count."""
    from transformers import AutoTokenizer

    limits = load_settings().limits
    path = embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(path), model_max_length=sys.maxsize)  # no length warning
    reads = json.loads((path / "sentence_bert_config.json").read_text())["max_seq_length"]
    window = reads - tokenizer.num_special_tokens_to_add()  # as the server's Embedder.window
    pieces = min(window, limits.max_embedding_tokens // MAX_INPUTS - limits.piece_cost_tokens)
    stream, texts = cycle(passages), []  # a text a passage or more; the set repeats past the dataset's
    while len(texts) < calls * MAX_INPUTS:
        text = ""
        while len(tokenizer.tokenize(text)) <= pieces:
            text = f"{text} {next(stream)}".strip()
        texts.append(cut(tokenizer, text, pieces))
    return [texts[i:i + MAX_INPUTS] for i in range(0, len(texts), MAX_INPUTS)], pieces


def cut(tokenizer, text: str, pieces: int) -> str:
    """The text up to the end of its last whole word within `pieces` word pieces: it tokenizes to that prefix."""
    spans = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    tokens = tokenizer.convert_ids_to_tokens(spans["input_ids"])
    end = next(j for j in range(pieces, 0, -1) if not tokens[j].startswith("##"))  # piece j starts a word
    return text[:spans["offset_mapping"][end - 1][1]]


def timed(send) -> dict:
    start = time.perf_counter()
    try:
        status = send().status_code
    except httpx.TransportError as exc:
        status = type(exc).__name__
    return {"status": status, "seconds": round(time.perf_counter() - start, 2)}


def lane_runs(http: httpx.Client, work: str, start: float, requests: list[Future]) -> float | None:
    """Seconds from `start` until the ingest lane runs a job of `work` ("embed", "upload"), from /health; None if
    the requests all ended first."""
    while (http.get("/health").json()["ingest"]["current"] or {}).get("work") != work:
        if all(request.done() for request in requests):
            return None
        time.sleep(0.05)
    return round(time.perf_counter() - start, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--delay", type=float, default=1.0, help="seconds from the lane's first embeddings "
                                                                "slice to the upload")
    parser.add_argument("--tenants", type=int, default=1, help="API keys the calls are spread over (1: no keys, "
                                                               "the default settings)")
    parser.add_argument("--dataset", type=Path, default=DATASET)
    args = parser.parse_args()
    passages = list(dict.fromkeys(ctx["text"] for item in json.loads(args.dataset.read_text()) for ctx in item["ctxs"]))
    inputs, pieces = maximal_inputs(passages[3:], args.calls)
    docs = iter({"id": f"upload-{n}", "title": "MuSiQue", "text": text} for n, text in zip(count(), passages[:3]))
    keys = {f"k-{n}": f"tenant-{n}" for n in range(args.tenants)} if args.tenants > 1 else {}
    headers = [{"Authorization": f"Bearer {key}"} for key in keys] or [{}]
    load_before = os.getloadavg()
    variables = {"RAGBLEND_SERVER__API_KEYS": json.dumps(keys)} if keys else {}
    with served_with(variables) as url, httpx.Client(base_url=url, timeout=3600) as http:

        def upload() -> dict:
            return timed(lambda: http.post("/v1/documents", json=next(docs), headers=headers[0]))
        log(f"warm-up upload: {upload()}")
        alone = upload()
        log(f"upload alone: {alone}")
        model = embedder_name(load_settings().embedder)

        def embed(n: int) -> dict:
            body = {"model": model, "input": inputs[n]}
            return timed(lambda: http.post("/v1/embeddings", json=body, headers=headers[n % len(headers)]))
        with ThreadPoolExecutor(args.calls + 1) as pool:
            log(f"{args.calls} calls of {MAX_INPUTS} texts of <= {pieces} word pieces at once")
            start = time.perf_counter()
            calls = [pool.submit(embed, n) for n in range(args.calls)]
            lane_s = lane_runs(http, "embed", start, calls)  # each call is priced first: the lane is free
            log(f"the lane embeds {lane_s} s after the calls' start")
            time.sleep(args.delay)
            sent = time.perf_counter()
            sending = pool.submit(upload)
            waited = lane_runs(http, "upload", sent, [sending])
            during = sending.result()
            log(f"upload during them: {during}, on the lane after {waited} s")
            embeddings = [call.result() for call in calls]
    print(json.dumps({"bench": "embed_lane", "commit": git_commit(), "loadavg_before": load_before,
                      "loadavg_after": os.getloadavg(), "calls": args.calls, "tenants": args.tenants,
                      "lane_embeds_after_s": lane_s, "delay_s": args.delay, "inputs_per_call": MAX_INPUTS,
                      "pieces_per_input": pieces, "upload_s": during["seconds"], "upload_status": during["status"],
                      "upload_lane_wait_s": waited,
                      "upload_alone_s": alone["seconds"], "embeddings": embeddings,
                      "target_met": during["status"] == 201 and during["seconds"] <= TARGET_S}, indent=2))


if __name__ == "__main__":
    main()
