"""Scale-out benchmark: a replica's search latency on a PostgreSQL collection, and how long its
FAISS index takes to catch up after another replica inserts (or deletes) chunks.

    python bench/scale.py [--base 10000] [--insert 10000] [--searches 300] [--kind flat]

Starts its own PostgreSQL (tests/servers.py). A writer fills the collection with `--base` chunks
(random unit vectors, 384-d like MiniLM, 300-token ids each); a replica (Retriever) opens on it
and searches; the writer inserts `--insert` more chunks in documents of 100; the replica's next
refresh (what runs before a search) catches up from the change log, timed, against a full
rebuild from the table; then the writer deletes 10 documents and that catch-up is timed too.
Search latency is the retrieval path without the question's embedding (a fixed set of random
query vectors): change check + FAISS search + chunk rows from PostgreSQL.
Prints JSON on stdout, progress on stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import git_commit  # noqa: E402
from retrieval import Chunk, DocumentInfo, Retriever, VectorIndex  # noqa: E402
from retrieval.postgres import PostgresMetadata  # noqa: E402
from tests.servers import PostgresServer  # noqa: E402

DIM, TOKENS, CHUNKS_PER_DOC = 384, 300, 100


def log(msg: str) -> None:
    print(f"[bench/scale] {msg}", file=sys.stderr, flush=True)


class RandomQueries:
    """Stands in for the embedder: the bench times retrieval, not MiniLM."""

    name, dim = "bench-random", DIM

    def __init__(self, seed: int = 0, n: int = 64) -> None:
        self.queries = unit(np.random.default_rng(seed).normal(size=(n, DIM)))
        self.i = 0

    def embed_query(self, text: str) -> np.ndarray:
        self.i += 1
        return self.queries[self.i % len(self.queries)]


def unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def documents(prefix: str, n_chunks: int, seed: int):
    """(DocumentInfo, chunks, vectors) in documents of CHUNKS_PER_DOC chunks."""
    rng = np.random.default_rng(seed)
    for d in range(0, n_chunks, CHUNKS_PER_DOC):
        n = min(CHUNKS_PER_DOC, n_chunks - d)
        doc_id = f"{prefix}-{d // CHUNKS_PER_DOC}"
        chunks = [Chunk(doc_id, i, f"{doc_id} passage {i} " + "lorem ipsum " * 100,
                        rng.integers(0, 49152, TOKENS).tolist(), 0, 1200, kv_key=f"{doc_id}-{i}") for i in range(n)]
        yield DocumentInfo(doc_id, doc_id, "bench", doc_id, n, time.time()), chunks, unit(rng.normal(size=(n, DIM)))


def insert(metadata: PostgresMetadata, prefix: str, n_chunks: int, seed: int) -> float:
    start = time.perf_counter()
    for doc in documents(prefix, n_chunks, seed):
        metadata.replace_documents([doc])
    return time.perf_counter() - start


def search_ms(replica: Retriever, n: int) -> dict[str, float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        hits = replica.search("question", top_k=4)
        times.append((time.perf_counter() - start) * 1e3)
        assert len(hits) == 4
    times.sort()
    return {"p50": round(statistics.median(times), 3), "p95": round(times[int(0.95 * (len(times) - 1))], 3)}


def timed_refresh(replica: Retriever) -> float:
    start = time.perf_counter()
    assert replica.refresh()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=int, default=10_000, help="chunks present when the replica opens")
    parser.add_argument("--insert", type=int, default=10_000, help="chunks another replica inserts")
    parser.add_argument("--searches", type=int, default=300)
    parser.add_argument("--kind", choices=["flat", "hnsw"], default="flat")
    args = parser.parse_args()

    with PostgresServer() as server, tempfile.TemporaryDirectory(prefix="ragblend-bench-scale-") as tmp:
        url = server.database()
        writer = PostgresMetadata(url)
        log(f"writing {args.base} base chunks")
        insert(writer, "base", args.base, seed=1)
        metadata = PostgresMetadata(url)
        start = time.perf_counter()
        replica = Retriever(Path(tmp), RandomQueries(), kind=args.kind, metadata=metadata)
        open_s = time.perf_counter() - start  # no FAISS file yet: built from the table
        marks_ms = []
        for _ in range(args.searches):
            t = time.perf_counter()
            metadata.marks()
            marks_ms.append((time.perf_counter() - t) * 1e3)
        before = search_ms(replica, args.searches)

        log(f"another replica inserts {args.insert} chunks")
        insert_s = insert(writer, "new", args.insert, seed=2)
        catch_up_s = timed_refresh(replica)
        assert len(replica) == args.base + args.insert
        start = time.perf_counter()
        rebuilt, _, _ = replica._synced(VectorIndex(DIM, args.kind))  # what a full rebuild would cost
        rebuild_s = time.perf_counter() - start
        assert len(rebuilt) == len(replica)
        after = search_ms(replica, args.searches)

        deleted_docs = min(10, -(-args.insert // CHUNKS_PER_DOC))  # whole documents of those just inserted
        for d in range(deleted_docs):
            writer.delete_document(f"new-{d}")
        delete_catch_up_s = timed_refresh(replica)
        deleted_chunks = sum(min(CHUNKS_PER_DOC, args.insert - d * CHUNKS_PER_DOC) for d in range(deleted_docs))
        assert len(replica) == args.base + args.insert - deleted_chunks
        replica.close()
        metadata.close()
        writer.close()

    commit = git_commit()
    print(json.dumps({
        "commit": commit, "loadavg_1m": round(os.getloadavg()[0], 2), "kind": args.kind,
        "base_chunks": args.base, "inserted_chunks": args.insert, "dim": DIM,
        "open_build_s": round(open_s, 3),
        "change_check_ms_p50": round(statistics.median(marks_ms), 3),
        "search_ms_before_insert": before,
        "insert_s": round(insert_s, 2), "insert_chunks_per_s": round(args.insert / insert_s),
        "catch_up_s": round(catch_up_s, 3),
        "full_rebuild_s": round(rebuild_s, 3),
        "search_ms_after_insert": after,
        "delete_catch_up_s": round(delete_catch_up_s, 4), "deleted_chunks": deleted_chunks,
        "note": "search excludes the question's embedding; PostgreSQL on loopback, fsync off",
    }, indent=2))


if __name__ == "__main__":
    main()
