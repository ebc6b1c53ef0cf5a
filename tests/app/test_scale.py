"""Scale-out (issue #17), against real servers started here: PostgreSQL and redis-server.

- two `ragblend serve` processes share one PostgreSQL and one Redis: a document uploaded at one is
  answered from at the other, with its KV read from Redis; a deletion at one reaches the other;
  SIGKILL mid-ingest leaves the collection as it was;
- `blend.precompute_at: first_use`: ingest stores no KV, the first query computes and stores it,
  the second is served from the store, and `ragblend store stats` counts both;
- Redis evicting under its maxmemory is a miss: the KV is recomputed and put back.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psycopg
import pytest
from typer.testing import CliRunner

import app.components
from app.cli.main import cli
from app.components import Components
from app.engine.query import QueryParams
from app.engine.rag_engine import RagEngine
from tests.app.conftest import CORPUS, MODELS, QUESTIONS, make_settings
from tests.helpers import shared_embedder, shared_llm
from tests.servers import RedisServer, listening_port

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")


def wait_for(condition, what: str, timeout_s: float = 60.0, every_s: float = 0.05):
    """Poll `condition()` until it returns something truthy (and return that)."""
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every_s)
    return result


@pytest.fixture
def shared_models(monkeypatch):
    """In-process Components reuse the session's SmolLM2 and MiniLM."""
    monkeypatch.setattr(app.components, "load_model", lambda *args, **kwargs: shared_llm())
    monkeypatch.setattr(app.components, "open_embedder", lambda settings: shared_embedder())


def store_stats(env: dict[str, str]) -> dict:
    """`ragblend store stats` with these RAGBLEND_* variables."""
    result = CliRunner().invoke(cli, ["store", "stats"], env=env)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


# ---- the KV lifecycle: first use, eviction ---------------------------------------------------------

def test_first_use_computes_kv_at_the_first_query_and_serves_the_second_from_the_store(tmp_path, shared_models):
    settings = make_settings(tmp_path / "data", blend={"precompute_at": "first_use"})
    parts = Components(settings)
    engine = RagEngine(settings, parts)
    try:
        for doc_id in ("harbor", "volcano", "chess"):
            title, text = CORPUS[doc_id]
            parts.ingestor.ingest_text(doc_id, title, text)
        keys = {c.kv_key for d in ("harbor", "volcano", "chess") for c in parts.retriever.document_chunks(d)}
        assert len(keys) == 3 and not any(parts.store.contains(k) for k in keys)  # ingest stored no KV
        assert parts.store.stats()["puts"] == 0

        question, doc_id, words = QUESTIONS[0]
        first = engine.answer(QueryParams(question, top_k=2, max_tokens=12))
        assert first.sources[0].doc_id == doc_id and any(w in first.answer for w in words), first.answer
        assert first.stats.store_hits == {"computed": 2}
        used = {c.kv_key for s in first.sources for c in parts.retriever.document_chunks(s.doc_id)}
        assert len(used) == 2 and used <= keys and all(parts.store.contains(k) for k in used)  # computed, stored
        second = engine.answer(QueryParams(question, top_k=2, max_tokens=12))
        assert second.stats.store_hits == {"memory": 2} and second.answer == first.answer  # the KV read back
    finally:
        parts.close()  # writes the last usage counts

    stats = store_stats({"RAGBLEND_DATA_DIR": str(settings.data_dir)})
    assert stats["retrieved_chunks"] == 4 and stats["hit_rate"] == 0.5
    assert stats["served"] == {"computed": {"chunks": 2, "share": 0.5}, "memory": {"chunks": 2, "share": 0.5}}
    assert stats["kv_entries_used"] == 2 and stats["bytes"]["disk"] > 0
    top = stats["most_used"][0]
    assert (top["hits"], top["computes"]) == (1, 1) and top["kv_key"] in used and top["last_used"] > 0


def test_redis_evicting_under_maxmemory_is_a_miss_recomputed_and_put_back(tmp_path, shared_models):
    # Redis is the only tier, capped below the collection's KV (~1-1.3 MB a passage in fp16): about
    # three entries fit (Redis itself takes ~1 MB, and a SET's input buffer counts while it runs).
    with RedisServer(maxmemory="6mb") as redis_server:
        # A loaded machine may take longer than the default timeout to SET a passage: that is an outage, not this.
        settings = make_settings(tmp_path / "data", store={"memory_bytes": 0, "disk_bytes": 0, "codec": "fp16",
                                                           "redis_url": redis_server.url, "redis_timeout_s": 10})
        parts = Components(settings)
        engine = RagEngine(settings, parts)
        try:
            for doc_id, (title, text) in CORPUS.items():
                parts.ingestor.ingest_text(doc_id, title, text)
            parts.store.flush()
            with redis_server.client() as raw:
                assert raw.info("stats")["evicted_keys"] > 0
            [redis_tier] = parts.store.tiers
            redis_stats = redis_tier.stats()
            assert redis_stats["policy"] == "allkeys-lru" and redis_stats["evictions"] > 0
            assert redis_stats["errors"] == 0  # evicted to make room, never refused
            evicted = [d for d in CORPUS if not redis_tier.contains(parts.retriever.document_chunks(d)[0].kv_key)]
            assert evicted, "the cap should have evicted some passages' KV"

            # Whichever passage was evicted (Redis samples keys to evict): its question misses, is
            # computed, answered, put back, then hit; greedy, its KV read back gives the same answer.
            question, doc_id = next((q, d) for q, d, _ in QUESTIONS if d in evicted)
            computed = engine.answer(QueryParams(question, top_k=1, max_tokens=12))
            assert computed.sources[0].doc_id == doc_id and computed.answer.strip()
            assert computed.stats.store_hits == {"computed": 1}  # a miss, not an error
            parts.store.flush()
            key = parts.retriever.document_chunks(doc_id)[0].kv_key
            assert redis_tier.contains(key)  # put back
            stored = engine.answer(QueryParams(question, top_k=1, max_tokens=12))
            assert stored.stats.store_hits == {"redis": 1} and stored.sources[0].doc_id == doc_id
            assert stored.answer == computed.answer
        finally:
            parts.close()


# ---- two replicas on one PostgreSQL and one Redis ------------------------------------------------

class Replica:
    """`ragblend serve` in its own process and data dir, on the loopback port it binds itself (port 0)."""

    def __init__(self, name: str, tmp: Path, env: dict[str, str]):
        self.name, self.url = name, ""
        self.log = tmp / f"{name}.log"
        self.env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
                    "RAGBLEND_DATA_DIR": str(tmp / name), **env}
        self.proc: subprocess.Popen | None = None

    def start(self) -> Replica:
        with self.log.open("w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "app.cli.main", "serve", "--host", "127.0.0.1",
                                          "--port", "0"], env=self.env, cwd=REPO,
                                         stdout=log, stderr=subprocess.STDOUT)
        try:
            self.url = f"http://127.0.0.1:{listening_port(self.proc, timeout_s=300)}"
        except RuntimeError:
            raise AssertionError(f"{self.name} exited: {self.log.read_text()[-3000:]}") from None
        wait_for(self._healthy, f"{self.name} to load", timeout_s=300, every_s=0.5)
        return self

    def _healthy(self) -> bool:
        assert self.proc.poll() is None, f"{self.name} exited: {self.log.read_text()[-3000:]}"
        try:
            return httpx.get(self.url + "/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    def post(self, path: str, body: dict, timeout: float = 120) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=timeout)

    def ask(self, question: str) -> dict:
        response = self.post("/v1/query", {"question": question, "top_k": 2, "max_tokens": 12})
        assert response.status_code == 200, response.text
        return response.json()

    def documents(self) -> list[str]:
        return [d["id"] for d in httpx.get(self.url + "/v1/documents", timeout=30).json()["data"]]

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def cluster(tmp_path, postgres_url):
    """Replicas a and b sharing one PostgreSQL database and one Redis (no memory cap here)."""
    with RedisServer() as redis_server:
        env = {"RAGBLEND_MODEL__CACHE_DIR": str(MODELS), "RAGBLEND_RETRIEVAL__DATABASE_URL": postgres_url,
               "RAGBLEND_STORE__REDIS_URL": redis_server.url, "RAGBLEND_STORE__REDIS_TIMEOUT_S": "2",
               # small chunks: the long document of the kill test has many, so its ingest takes a while
               "RAGBLEND_CHUNKING__TARGET_TOKENS": "64", "RAGBLEND_CHUNKING__MAX_TOKENS": "80",
               "RAGBLEND_CHUNKING__MIN_TOKENS": "8"}
        replicas = [Replica(name, tmp_path, env) for name in ("a", "b")]
        try:
            for replica in replicas:  # one after the other: the second migrates nothing
                replica.start()
            yield replicas, redis_server, postgres_url, env
        finally:
            for replica in replicas:
                replica.stop()


def test_two_replicas_share_documents_through_postgres_and_kv_through_redis(cluster, tmp_path):
    (a, b), redis_server, postgres_url, env = cluster

    # 1. Upload through A: chunks in PostgreSQL, KV precomputed by A into its tiers and Redis.
    for doc_id in ("harbor", "volcano"):
        title, text = CORPUS[doc_id]
        response = a.post("/v1/documents", {"id": doc_id, "title": title, "text": text})
        assert response.status_code == 201, response.text
    with psycopg.connect(postgres_url) as db:
        keys = [k for (k,) in db.execute("SELECT kv_key FROM chunks ORDER BY id")]
    assert len(keys) == 2  # one chunk each
    with redis_server.client() as raw:
        wait_for(lambda: all(raw.exists("ragblend:" + k) for k in keys), "A's background writes to Redis")

    # 2. Asked at B, which never saw the upload: retrieved, and its KV read from Redis, not recomputed.
    assert b.documents() == ["harbor", "volcano"]
    question, doc_id, words = QUESTIONS[0]
    answer = b.ask(question)
    assert answer["sources"][0]["doc_id"] == doc_id and any(w in answer["answer"] for w in words), answer
    assert answer["stats"]["store_hits"] == {"redis": 2}

    # 3. Deleted through B: gone from A's answers.
    assert httpx.delete(f"{b.url}/v1/documents/{doc_id}", timeout=60).status_code == 200
    assert doc_id not in {s["doc_id"] for s in a.ask(question)["sources"]}
    assert a.documents() == ["volcano"]

    # 4. The CLI sees what every replica served (B's two Redis hits, A's own query).
    cli_env = {k: v for k, v in env.items() if k.startswith("RAGBLEND_")} | {"RAGBLEND_DATA_DIR": str(tmp_path / "cli")}
    stats = wait_for(lambda: (s := store_stats(cli_env))["retrieved_chunks"] >= 3 and s, "usage to be flushed",
                     timeout_s=30, every_s=0.5)
    assert stats["served"]["redis"]["chunks"] >= 2 and stats["bytes"]["redis"] > 0

    # 5. A killed (SIGKILL) mid-ingest: the collection is as it was before that document.
    with psycopg.connect(postgres_url) as db:
        before = db.execute("SELECT COUNT(*), MAX(id) FROM chunks").fetchone()
    text = " ".join(f"Fact {i}: the tide gauge number {i} at Kelmouth reads {i * 7} centimetres." for i in range(80))
    upload = threading.Thread(target=lambda: _ignore_transport_errors(
        lambda: a.post("/v1/documents", {"id": "tides", "title": "Kelmouth tides", "text": text}, timeout=300)))
    with redis_server.client() as raw:
        stored = raw.dbsize()
        upload.start()
        wait_for(lambda: raw.dbsize() > stored + 1, "A to be precomputing the new document", timeout_s=120,
                 every_s=0.01)
    a.kill()
    upload.join(30)
    assert b.documents() == ["volcano"]
    with psycopg.connect(postgres_url) as db:
        assert db.execute("SELECT COUNT(*), MAX(id) FROM chunks").fetchone() == before
    assert "tides" not in {s["doc_id"] for s in b.ask("What does tide gauge number 12 at Kelmouth read?")["sources"]}
    title, text = CORPUS["chess"]  # and the collection still takes writes
    assert b.post("/v1/documents", {"id": "chess", "title": title, "text": text}).status_code == 201
    assert b.documents() == ["chess", "volcano"]


def _ignore_transport_errors(call) -> None:
    try:
        call()
    except httpx.TransportError:  # the server was killed under the request
        pass
