"""Ingest benchmark: embedding and KV-precompute throughput, and index search latency.

    python bench/ingest.py [--chunks 64] [--kv-chunks 8] [--sizes 10000,100000] [--queries 200]

Prints JSON on stdout, progress on stderr.
- embed: MiniLM over real chunks (MuSiQue passages through the default chunker; the demo corpus
  if the data is missing), batched as ingest does.
- kv_precompute: app.engine.kv.ChunkKVCache.ensure on the same chunks into a fresh tiered store (every
  one a miss: the blended-prefix forward pass plus the store write).
- search: FAISS top-4 latency per query over synthetic unit vectors (dim 384), flat and HNSW,
  after a warm-up; plus the question-embedding time a real search adds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from retrieval import Chunk, Chunker, VectorIndex  # noqa: E402
from tests.helpers import MUSIQUE, ROOT, load_musique, shared_embedder, shared_llm, test_settings  # noqa: E402

DIM, TOP_K = 384, 4


def log(msg: str) -> None:
    print(f"[bench/ingest] {msg}", file=sys.stderr, flush=True)


def sample_chunks(n: int, tokenizer) -> list[tuple[Chunk, str | None]]:
    """The first `n` chunks of MuSiQue passages (or of the demo corpus), with their titles."""
    chunker = Chunker(tokenizer)
    if MUSIQUE.exists():
        docs = [(c["title"] or None, c["text"]) for q in load_musique(max(1, n // 10 + 1)) for c in q["ctxs"]]
    else:
        docs = [(p.stem, p.read_text()) for p in sorted((ROOT / "corpus").rglob("*.*"))]
    chunks = [(chunk, title) for i, (title, text) in enumerate(docs) for chunk in chunker.chunk(str(i), text)]
    return chunks[:n]


def bench_embed(chunks: list[tuple[Chunk, str | None]]) -> dict:
    from retrieval.retriever import embedding_text

    embedder = shared_embedder()
    texts = [embedding_text(c.text, title) for c, title in chunks]
    embedder.embed(texts[:embedder.batch_size])  # warm-up
    start = time.perf_counter()
    embedder.embed(texts, progress=lambda n: log(f"embedded {n} chunks"))
    seconds = time.perf_counter() - start
    query_ms = [_ms(lambda: embedder.embed_query("When was the lighthouse built?")) for _ in range(20)]
    return {"chunks": len(texts), "seconds": round(seconds, 2), "chunks_per_s": round(len(texts) / seconds, 1),
            "batch_size": embedder.batch_size, "query_embed_ms_p50": round(statistics.median(query_ms), 2)}


def bench_kv(chunks: list[tuple[Chunk, str | None]]) -> dict:
    from app.components import Components

    with tempfile.TemporaryDirectory(prefix="ragblend-bench-") as tmp:
        settings = test_settings(Path(tmp))
        parts = Components(settings)
        parts.llm = shared_llm()  # loaded once per process
        kv_cache = parts.kv_cache
        kv_cache.head()  # computed once per process, not per chunk
        tokens, start = 0, time.perf_counter()
        for i, (chunk, title) in enumerate(chunks, 1):
            ids = kv_cache.passage_ids(chunk.token_ids, title)
            kv_cache.ensure(ids)
            tokens += len(ids)
            log(f"KV precomputed {i}/{len(chunks)}")
        seconds = time.perf_counter() - start
        parts.close()
    return {"chunks": len(chunks), "seconds": round(seconds, 2), "chunks_per_s": round(len(chunks) / seconds, 2),
            "tokens_per_s": round(tokens / seconds, 1), "mean_tokens": round(tokens / len(chunks), 1),
            "precompute": settings.blend.precompute, "codecs": settings.store.codecs()}


def bench_search(size: int, kind: str, queries: int) -> dict:
    rng = np.random.default_rng(0)
    vectors = _unit(rng.standard_normal((size, DIM), dtype=np.float32))
    start = time.perf_counter()
    index = VectorIndex.build(DIM, kind, np.arange(size, dtype=np.int64), vectors)
    build_s = time.perf_counter() - start
    probes = _unit(rng.standard_normal((queries, DIM), dtype=np.float32))
    for q in probes[:10]:
        index.search(q, TOP_K)  # warm-up
    times = [_ms(lambda q=q: index.search(q, TOP_K)) for q in probes]
    return {"size": size, "kind": kind, "build_s": round(build_s, 2), "p50_ms": round(statistics.median(times), 3),
            "p95_ms": round(float(np.percentile(times, 95)), 3)}


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def _ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=64, help="chunks to embed")
    parser.add_argument("--kv-chunks", type=int, default=8, help="chunks to precompute KV for (0: skip)")
    parser.add_argument("--sizes", default="10000,100000", help="index sizes for the search benchmark")
    parser.add_argument("--kinds", default="flat,hnsw")
    parser.add_argument("--queries", type=int, default=200)
    args = parser.parse_args()

    import faiss
    import torch

    from tests.helpers import shared_tokenizer

    result: dict = {"threads": {"torch": torch.get_num_threads(), "faiss": faiss.omp_get_max_threads()}}
    chunks = sample_chunks(max(args.chunks, args.kv_chunks), shared_tokenizer())
    log(f"embedding {args.chunks} chunks")
    result["embed"] = bench_embed(chunks[:args.chunks])
    if args.kv_chunks:
        log(f"precomputing KV for {args.kv_chunks} chunks")
        result["kv_precompute"] = bench_kv(chunks[:args.kv_chunks])
    result["search"] = []
    for size in (int(s) for s in args.sizes.split(",") if s):
        for kind in args.kinds.split(","):
            log(f"search: {kind} index of {size} vectors")
            result["search"].append(bench_search(size, kind, args.queries))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
