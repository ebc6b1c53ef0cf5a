"""SIGTERM on a real `ragblend serve` process.

In the middle of an upload: it exits cleanly (code 0, no traceback, its threads ended before the store
closed), the upload is rolled back, and what was committed before is intact — metadata, index and KV
entries. In the middle of streams: a stream that ends within `server.shutdown_grace_s` closes with its
normal final event (`result`; a finish chunk and `[DONE]`), one still running when the grace ends gets an
explicit `shutting_down` error event; no client sees an answer cut without a word."""
from __future__ import annotations

import json
import os
import random
import signal
import string
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from retrieval import Retriever
from store import build_store
from tests.app.test_ingest_lane import send_upload, wait_for
from tests.helpers import ROOT, shared_embedder, test_settings
from tests.servers import listening_port

pytestmark = pytest.mark.slow

GRACE_S = 3
HANG_GUARD_S = 120  # grace + one chunk's precompute or one embedding batch, far apart: only a hang reaches it


@contextmanager
def serve(data_dir: Path, **env: str) -> Iterator[tuple[subprocess.Popen, httpx.Client]]:
    """`ragblend serve` on a port of its own over `data_dir`, ready; the process (its log in `server.log`
    beside `data_dir`: a pipe nobody reads would fill and stall it) and a client on it."""
    env = {**os.environ, "RAGBLEND_DATA_DIR": str(data_dir), "RAGBLEND_MODEL__CACHE_DIR": str(ROOT / "data" / "models"),
           "RAGBLEND_LOG_LEVEL": "INFO", **env}
    with open(data_dir.parent / "server.log", "w") as log:
        server = subprocess.Popen([sys.executable, "-m", "app.cli.main", "serve", "--port", "0"], cwd=ROOT, env=env,
                                  stdout=subprocess.DEVNULL, stderr=log, text=True)
    server.log_path = data_dir.parent / "server.log"
    try:
        try:
            url = f"http://127.0.0.1:{listening_port(server, timeout_s=300)}"  # the port it bound itself
        except RuntimeError:
            raise AssertionError(server.log_path.read_text()[-3000:]) from None
        with httpx.Client(base_url=url, timeout=300) as http:
            wait_for(lambda: health(http).get("status") == "ok" or server.poll() is not None, 300, "the server")
            assert server.poll() is None, server.log_path.read_text()[-3000:]
            yield server, http
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def health(http: httpx.Client) -> dict:
    try:
        return http.get("/health").json()
    except httpx.TransportError:
        return {}


def exited(server: subprocess.Popen) -> list[dict]:
    """The log records of a server sent SIGTERM, once it has exited, after checking it exited cleanly."""
    server.wait(timeout=HANG_GUARD_S)
    stderr = server.log_path.read_text()
    assert server.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr and "ASGI callable returned without completing" not in stderr, stderr[-3000:]
    records = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    messages = [r["msg"] for r in records]
    assert messages.index("shutting down") < messages.index("stopped"), messages
    return records


def test_sigterm_during_an_upload_exits_cleanly_and_loses_nothing(tmp_path):
    data_dir = tmp_path / "data"
    # No warm-up requests: their KV (a tenant of their own) would blur the store's exact count below.
    with serve(data_dir, RAGBLEND_SERVER__SHUTDOWN_GRACE_S=str(GRACE_S), RAGBLEND_SERVER__WARM_UP="false") as (
            server, http):
        kept = http.post("/v1/documents", json={"id": "kept", "title": "Kestrel Bakery",
                                                "text": "The Kestrel Bakery bakes rye bread every Tuesday."})
        assert kept.status_code == 201, kept.text

        rng = random.Random(1)
        noise = "".join(rng.choices(string.ascii_letters, k=60_000))  # ~125 chunks of precompute
        upload = send_upload(str(http.base_url), {"id": "interrupted", "title": "Noise", "text": noise})
        wait_for(lambda: (health(http).get("model_thread", {}).get("current") or {}).get("work", "")
                 .startswith("upload"), 300, "the upload's KV precompute")
        server.send_signal(signal.SIGTERM)
        records = exited(server)
        upload.close()
    # The lane and the model thread ended before the store and the database were closed.
    [stopped] = [r for r in records if r["msg"] == "stopped"]
    assert stopped["clean"] is True, records

    # What was committed is intact; the interrupted upload left nothing.
    settings = test_settings(data_dir)
    retriever = Retriever(settings.index_dir, shared_embedder())
    try:
        assert [d.id for d in retriever.list_documents()] == ["kept"]
        keys = [c.kv_key for c in retriever.document_chunks("kept")]
        assert len(retriever) == len(keys) == 1
        assert [h.chunk.doc_id for h in retriever.search("rye bread", 1)] == ["kept"]
    finally:
        retriever.close()
    with build_store(settings.store, settings.kv_dir, fingerprint=None) as store:
        assert all(store.contains(key) for key in keys)
        disk = store.stats()["tiers"]["disk"]
        assert disk["entries"] == 2  # the prompt head and the kept chunk: no orphan of the upload


class Stream(threading.Thread):
    """One streaming request read to its end: its (event, data) pairs, and whether the connection was cut."""

    def __init__(self, http: httpx.Client, path: str, body: dict):
        super().__init__(daemon=True)
        self.http, self.path, self.body = http, path, body
        self.events: list[tuple[str, str]] = []
        self.cut: Exception | None = None
        self.answering = threading.Event()  # its first event has arrived (sent once the first text is there)

    def run(self) -> None:
        try:
            with self.http.stream("POST", self.path, json=self.body) as response:
                assert response.status_code == 200, response.read()
                name = "message"
                for line in response.iter_lines():
                    if line.startswith("event:"):
                        name = line[6:].strip()
                    elif line.startswith("data:"):
                        self.events.append((name, line[5:].strip()))
                        name = "message"
                        self.answering.set()
        except httpx.TransportError as exc:  # the connection closed before the response ended
            self.cut = exc
        finally:
            self.answering.set()


def test_sigterm_during_streams_ends_each_with_its_final_event_or_shutting_down(tmp_path):
    """Three streams answering at SIGTERM: two short ones end within the grace, each with its normal final
    event; a long one (4,000 tokens) is still running when the grace ends and gets the shutting_down error.
    A request on a new connection during the drain is refused with a 503 and Retry-After."""
    fact = "The Kestrel Bakery in Dunmore bakes rye bread with caraway seeds every Tuesday."
    with serve(tmp_path / "data", RAGBLEND_SERVER__SHUTDOWN_GRACE_S="20",
               RAGBLEND_LIMITS__MAX_NEW_TOKENS="4000") as (server, http):
        assert http.post("/v1/documents", json={"id": "bakery", "text": fact}).status_code == 201
        question = "What does the Kestrel Bakery bake?"
        streams = {
            "long query": Stream(http, "/v1/query", {"question": question, "stream": True, "max_tokens": 4000,
                                                     "ignore_eos": True}),
            "short query": Stream(http, "/v1/query", {"question": question, "stream": True, "max_tokens": 12,
                                                      "ignore_eos": True}),
            "short chat": Stream(http, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": question}], "stream": True, "max_tokens": 12}),
        }
        for stream in streams.values():
            stream.start()
        for name, stream in streams.items():
            assert stream.answering.wait(300), name
        server.send_signal(signal.SIGTERM)
        # a new connection while the streams drain: the listener is open, the answer a 503
        late = httpx.post(http.base_url.join("/v1/query"), json={"question": question}, timeout=60)
        assert late.status_code == 503 and int(late.headers["Retry-After"]) >= 1, late.text
        assert late.json()["error"]["code"] == "shutting_down"
        for stream in streams.values():
            stream.join(HANG_GUARD_S)
        exited(server)

    for name, stream in streams.items():
        assert stream.cut is None, (name, stream.cut, stream.events[-3:])
    short_query = streams["short query"].events
    assert short_query[-1][0] == "result" and json.loads(short_query[-1][1])["finish_reason"] == "length"
    assert {name for name, _ in short_query[:-1]} == {"delta"}
    chat = streams["short chat"].events
    assert chat[-1] == ("message", "[DONE]")
    finishes = [c["choices"][0]["finish_reason"] for c in map(json.loads, (d for _, d in chat[:-1])) if c["choices"]]
    assert finishes[-1] in ("stop", "length") and set(finishes[:-1]) == {None}
    long_query = streams["long query"].events
    assert long_query[-1][0] == "error", long_query[-3:]
    assert json.loads(long_query[-1][1])["error"]["code"] == "shutting_down"
    assert {name for name, _ in long_query[:-1]} == {"delta"}
