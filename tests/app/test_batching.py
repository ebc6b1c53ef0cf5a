"""Batched decoding on the real model (SmolLM2-135M) through a real uvicorn server: each request gets
exactly the greedy tokens it gets alone, whether 1, 2, 3 or 4 requests of different prompt and answer
lengths run together, joining while the others decode; a request cancelled mid-stream changes nothing
for the others and frees its decode pool slot; a request longer than a pool slot gets a 400 saying so."""
from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytestmark = pytest.mark.slow

# (question index, top_k, max_tokens): prompts of one or two passages, answers of 6 to 20 tokens.
CASES = [(0, 1, 20), (1, 2, 9), (2, 1, 14), (3, 2, 6)]


def body(corpus, case: tuple[int, int, int]) -> dict:
    index, top_k, max_tokens = case
    return {"question": corpus.questions[index][0], "top_k": top_k, "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}  # ignore_eos: every answer runs its full length


def stream(url: str, request: dict, deltas_seen: threading.Event | None = None, hang_up_after: int | None = None
           ) -> tuple[str, dict | None]:
    """The streamed text and the final result; sets `deltas_seen` after the second delta."""
    text, result, name, n = "", None, None, 0
    with httpx.stream("POST", f"{url}/v1/query", json=request, timeout=300) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data = json.loads(line[5:])
                if name == "delta":
                    text, n = text + data["delta"], n + 1
                    if n == 2 and deltas_seen is not None:
                        deltas_seen.set()
                    if hang_up_after is not None and n == hang_up_after:
                        return text, None
                elif name == "result":
                    result = data
    return text, result


def decode_steps(url: str, name: str = "decode_steps") -> dict[int, float]:
    """/metrics' ragblend:<name>_total by rows."""
    metrics = httpx.get(f"{url}/metrics").text
    return {int(rows): float(count) for rows, count in
            re.findall(rf'^ragblend:{name}_total\{{rows="(\d+)"\}} ([0-9.e+-]+)$', metrics, re.MULTILINE)}


@pytest.fixture(scope="module")
def alone(live_server, corpus) -> list[tuple[str, dict]]:
    """Each case on its own: the reference."""
    return [stream(live_server.url, body(corpus, case)) for case in CASES]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_concurrent_requests_get_exactly_their_tokens_alone(live_server, corpus, alone, n):
    before = decode_steps(live_server.url)
    started = [threading.Event() for _ in range(n)]

    def run(i: int) -> tuple[str, dict]:
        if i:  # join while the earlier ones are decoding
            assert started[i - 1].wait(120)
        return stream(live_server.url, body(corpus, CASES[i]), started[i])

    with ThreadPoolExecutor(n) as pool:
        together = list(pool.map(run, range(n)))
    for i, (text, result) in enumerate(together):
        assert text == alone[i][0], f"request {i}"
        assert result["stats"]["completion_tokens"] == CASES[i][2] == alone[i][1]["stats"]["completion_tokens"]
    after = decode_steps(live_server.url)
    shared = {rows: after.get(rows, 0) - before.get(rows, 0) for rows in after if rows >= 2}
    assert sum(shared.values()) > 0, f"no step decoded two requests together: {after}"
    seconds = decode_steps(live_server.url, "decode_step_seconds")  # every batch size run took time
    assert sorted(seconds) == sorted(after) and all(seconds[rows] > 0 for rows in after), (seconds, after)


def test_a_request_cancelled_mid_stream_changes_nothing_for_the_others(live_server, server_engine, corpus, alone):
    cases = [0, 1, 2]
    started = [threading.Event() for _ in cases]

    def run(i: int) -> tuple[str, dict | None]:
        if i:
            assert started[i - 1].wait(120)
        hang_up = 4 if i == 1 else None  # the second client leaves after 4 deltas
        return stream(live_server.url, body(corpus, CASES[i]), started[i], hang_up_after=hang_up)

    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(run, cases))
    assert results[1][1] is None and alone[1][0].startswith(results[1][0])
    for i in (0, 2):
        assert results[i][0] == alone[i][0], f"request {i}"
    health = httpx.get(f"{live_server.url}/health").json()
    assert health["model_thread"]["active_slots"] == 0  # the cancelled one's slot is free
    pool = server_engine.parts.runtime.pool
    assert pool.free == pool.slots  # and so is its decode KV pool slot


def test_a_request_longer_than_the_decode_pool_gets_a_400_with_the_reason(engine_with, corpus):
    """A request that would pass a pool slot's length is refused before it starts, saying why."""
    from fastapi.testclient import TestClient

    from app.api.server import create_app

    settings, engine = engine_with(model={"kv_pool_tokens": 100})
    with TestClient(create_app(settings, engine)) as client:
        response = client.post("/v1/query", json={"question": corpus.questions[0][0], "top_k": 2, "max_tokens": 8})
        assert response.status_code == 400, response.text
        assert "100-token context" in response.text and "decode KV pool" in response.text
    assert engine.parts.runtime.pool.free == engine.parts.runtime.pool.slots
