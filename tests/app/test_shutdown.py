"""SIGTERM on a real `ragblend serve` process in the middle of an upload: it exits cleanly (code 0, no
traceback) within the shutdown bound, the upload is rolled back, and what was committed before is
intact — metadata, index and KV entries."""
from __future__ import annotations

import os
import random
import signal
import string
import subprocess
import sys
import time

import httpx
import pytest

from retrieval import Retriever
from store import build_store
from tests.app.test_ingest_lane import send_upload, wait_for
from tests.helpers import ROOT, shared_embedder, test_settings
from tests.servers import listening_port

pytestmark = pytest.mark.slow

GRACE_S = 3
BOUND_S = 30  # grace + one chunk's precompute or one embedding batch, with room for a loaded machine


def test_sigterm_during_an_upload_exits_cleanly_and_loses_nothing(tmp_path):
    data_dir = tmp_path / "data"
    env = {**os.environ, "RAGBLEND_DATA_DIR": str(data_dir), "RAGBLEND_MODEL__CACHE_DIR": str(ROOT / "data" / "models"),
           "RAGBLEND_SERVER__SHUTDOWN_GRACE_S": str(GRACE_S)}
    server = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--port", "0"], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        try:
            url = f"http://127.0.0.1:{listening_port(server, timeout_s=300)}"  # the port it bound itself
        except RuntimeError:
            raise AssertionError(server.communicate()[1][-3000:]) from None
        with httpx.Client(base_url=url, timeout=120) as http:
            def health() -> dict:
                try:
                    return http.get("/health").json()
                except httpx.TransportError:
                    return {}

            wait_for(lambda: health().get("status") == "ok" or server.poll() is not None, 300, "the server")
            assert server.poll() is None, server.communicate()[1]
            kept = http.post("/v1/documents", json={"id": "kept", "title": "Kestrel Bakery",
                                                    "text": "The Kestrel Bakery bakes rye bread every Tuesday."})
            assert kept.status_code == 201, kept.text

            rng = random.Random(1)
            noise = "".join(rng.choices(string.ascii_letters, k=60_000))  # ~125 chunks of precompute
            upload = send_upload(url, {"id": "interrupted", "title": "Noise", "text": noise})
            wait_for(lambda: (health().get("model_thread", {}).get("current") or {}).get("work", "")
                     .startswith("upload"), 300, "the upload's KV precompute")
            start = time.monotonic()
            server.send_signal(signal.SIGTERM)
            _, stderr = server.communicate(timeout=BOUND_S + 30)
            seconds = time.monotonic() - start
            upload.close()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    print(f"exit after SIGTERM: {seconds:.1f}s, code {server.returncode}")
    assert server.returncode == 0, stderr[-3000:]
    assert seconds < BOUND_S
    assert "Traceback" not in stderr, stderr[-3000:]

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
