"""The threads a serving process runs are the ones ARCHITECTURE.md's thread table lists.

`python tests/app/test_threads.py DATA_DIR` is the probe: it serves the real app as `ragblend serve` does (the engine
loaded in the background, uvicorn on the main thread), drives it through every kind of work (uploads, a query, a
streamed chat and its repeat, a cache lookup, leases, the page, /metrics), samples `threading.enumerate()` all the
while, and prints the thread names it saw as JSON. The test runs it in a fresh process (no other test's threads) and
checks each name, its pool suffix taken off, against the table."""
from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROBE = "probe-"  # the probe's own threads (client, sampler): not the server's
MAX_KINDS = 8  # kinds while serving without Redis (issue #54)


def kind(name: str) -> str:
    """A thread's kind: its name without a pool's worker number (ragblend-store-read_2 -> ragblend-store-read)."""
    return re.sub(r"_\d+$", "", name)


def table_kinds() -> dict[str, str]:
    """ARCHITECTURE.md's thread table: each thread name (in backticks, first column) -> what it does."""
    text = (REPO / "ARCHITECTURE.md").read_text()
    table = text[text.index("**Threads**"):].split("\n\n")[1]
    rows = [line.split("|")[1:3] for line in table.splitlines() if line.startswith("| `")]
    return {name: does.strip() for cell, does in rows for name in re.findall(r"`([^`]+)`", cell)}


def test_every_thread_while_serving_is_in_the_architecture_table(tmp_path):
    done = subprocess.run([sys.executable, __file__, str(tmp_path)], capture_output=True, text=True, timeout=900,
                          cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    table = table_kinds()
    kinds = {kind(name) for name in seen if not name.startswith(PROBE)}
    assert {"MainThread", "ragblend-model", "ragblend-store-put", "ragblend-ingest", "AnyIO worker thread"} <= kinds
    assert "ragblend-housekeeping" not in kinds  # a server's periodic work runs from its event loop
    assert kinds <= set(table), f"threads not in ARCHITECTURE.md's table: {sorted(kinds - set(table))}"
    serving = {k for k in kinds if "only" not in table[k].split(":")[0]}  # start-up / shutdown only: not serving
    assert len(serving) <= MAX_KINDS, sorted(serving)
    assert not any(name.startswith(("asyncio_", "Thread-")) for name in seen), seen  # no unnamed pool or thread


def ready(client) -> bool:
    """Whether /health/ready is 200 (False while uvicorn has not begun listening on the socket yet)."""
    import httpx

    try:
        return client.get("/health/ready").status_code == 200
    except httpx.ConnectError:
        return False


def probe(data_dir: str) -> None:
    import httpx
    import uvicorn

    from app.api.server import create_app
    from tests.app.conftest import CORPUS, make_settings

    settings = make_settings(Path(data_dir))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = "http://127.0.0.1:%d" % sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(settings), log_level="warning", access_log=False))
    seen: set[str] = set()
    finished = threading.Event()

    def sample() -> None:
        while not finished.is_set():
            seen.update(t.name for t in threading.enumerate())
            time.sleep(0.002)

    def drive() -> None:
        try:
            with httpx.Client(base_url=url, timeout=600) as client:
                while not ready(client):
                    time.sleep(0.2)
                seen.clear()  # serving from here on (the loader's thread has ended)
                threading.Thread(target=sample, name=f"{PROBE}sampler", daemon=True).start()
                for doc_id, (title, text) in list(CORPUS.items())[:2]:
                    assert client.post("/v1/documents", json={"id": doc_id, "title": title, "text": text}
                                       ).status_code == 201
                assert client.post("/v1/query", json={"question": "Who built the lighthouse?"}).status_code == 200
                chat = {"messages": [{"role": "user", "content": " ".join(t for _, t in list(CORPUS.values())[:2])
                                      + " Who founded the bakery?"}], "max_tokens": 4, "stream": True,
                        "prompt_cache_retention": "24h", "prompt_cache_key": "probe"}
                for _ in range(2):  # the repeat reads the first one's spans
                    with client.stream("POST", "/v1/chat/completions", json=chat) as streamed:
                        assert streamed.status_code == 200
                        streamed.read()
                assert client.post("/v1/cache/lookup", json={"messages": chat["messages"]}).status_code == 200
                for path in ("/", "/v1/cache", "/metrics", "/v1/models", "/v1/documents"):
                    assert client.get(path).status_code == 200, path
                time.sleep(2.5)  # the periodic work runs (usage flush, lease sweep)
                assert client.get("/v1/cache").json()["leases"] > 0  # the chats' leases (the "store" pool) hold
        finally:
            finished.set()
            server.should_exit = True

    threading.Thread(target=drive, name=f"{PROBE}client", daemon=True).start()
    server.run(sockets=[sock])
    print(json.dumps(sorted(seen)))


if __name__ == "__main__":
    probe(sys.argv[1])
