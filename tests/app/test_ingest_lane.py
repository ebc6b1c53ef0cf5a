"""Uploads without a single space (issue #15's attack) while queries keep coming: chunking and
embedding run on the ingest lane, only each chunk's KV precompute on the model thread, between the
queries' work — so a query answers while the upload is still going, whichever phase it is in (the
order is asserted; the seconds are printed, speed is bench/'s); and an uploading client's disconnect
stops its upload with nothing committed and its KV entries removed."""
from __future__ import annotations

import json
import random
import socket
import string
import threading
import time
from urllib.parse import urlparse

import httpx
import pytest

pytestmark = pytest.mark.slow

LIMITS = {"max_document_chars": 3_000_000, "max_body_bytes": 4_000_000}


def send_upload(url: str, doc: dict) -> socket.socket:
    """POST the document on a raw socket and return it unread: closing it is the client going away."""
    body = json.dumps(doc).encode()
    address = urlparse(url)
    sock = socket.create_connection((address.hostname, address.port))
    sock.sendall(b"POST /v1/documents HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    return sock


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


class Client:
    def __init__(self, http: httpx.Client, corpus):
        self.http = http
        self.question, self.doc_id, _ = corpus.questions[0]

    def health(self) -> dict:
        return self.http.get("/health").json()

    def uploading(self) -> bool:
        return self.health()["ingest"]["current"] is not None

    def precomputing(self) -> bool:
        thread = self.health()["model_thread"]
        return (thread["current"] or {}).get("work", "").startswith("upload") or thread["model_tasks_waiting"] > 0

    def query_seconds(self) -> float:
        start = time.monotonic()
        response = self.http.post("/v1/query", json={"question": self.question, "top_k": 1, "max_tokens": 6})
        assert response.status_code == 200, response.text
        assert response.json()["sources"][0]["doc_id"] == self.doc_id
        return time.monotonic() - start


def test_a_2mb_no_space_upload_completes_while_queries_answer(make_app, corpus, serve_live):
    with serve_live(make_app(limits=LIMITS)) as live, httpx.Client(base_url=live.url, timeout=300) as http:
        client = Client(http, corpus)
        done: dict = {}
        upload = threading.Thread(target=lambda: done.update(response=http.post(
            "/v1/documents", json={"id": "no-spaces", "title": "Attack", "text": "a" * 2_000_000})))
        upload.start()
        wait_for(client.uploading, 30, "the upload to start")
        seconds = client.query_seconds()
        overlapped = client.uploading()
        upload.join(300)
        print(f"query during the 2 MB upload: {seconds:.1f}s")
        assert overlapped  # answered while the upload was still going, not after it
        assert done["response"].status_code == 201, done["response"].text
        assert done["response"].json()["data"][0]["n_chunks"] > 1000
        assert http.delete("/v1/documents/no-spaces").status_code == 200


def test_queries_pass_an_upload_being_precomputed_and_its_client_can_stop_it(make_app, corpus, serve_live,
                                                                            server_engine):
    rng = random.Random(0)
    text = "".join(rng.choices(string.ascii_letters + string.digits, k=60_000))  # ~125 distinct chunks
    parts = server_engine.parts
    keys = [parts.kv_cache.key(parts.kv_cache.passage_ids(c.token_ids, "Noise"))
            for c in parts.chunker.chunk("noise", text)]
    with serve_live(make_app(limits=LIMITS)) as live, httpx.Client(base_url=live.url, timeout=300) as http:
        client = Client(http, corpus)
        upload = send_upload(live.url, {"id": "noise", "title": "Noise", "text": text})
        try:
            wait_for(client.uploading, 30, "the upload to start")
            while_preparing = client.query_seconds()  # chunking and embedding on the lane
            wait_for(client.precomputing, 300, "the upload's KV precompute")
            while_precomputing = client.query_seconds()  # one chunk at a time on the model thread
            assert client.uploading(), "the upload should still be running"
        finally:
            upload.close()  # the client goes away
        print(f"query during chunking/embedding {while_preparing:.1f}s, during precompute {while_precomputing:.1f}s")

        wait_for(lambda: not client.uploading(), 60, "the upload to stop")
        assert http.get("/v1/documents/noise").status_code == 404  # nothing committed
        assert not any(parts.store.contains(key) for key in keys)  # and no KV entry left behind
        assert client.health()["model_thread"]["model_tasks_waiting"] == 0
