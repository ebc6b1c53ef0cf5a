"""The scheduler's queue contract, on a stub engine whose timing the test controls: at most
`server.max_batch` requests at a time, 429 when the queue is full, 503 after the queue timeout, a
disconnect (streaming or not) stops generation and frees the slot, /health answers 503 while the
engine loads and while the model thread is stuck, and the liveness/readiness pair."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fastapi.testclient import TestClient

import app.api.server as server

QUERY = {"question": "anything?", "max_tokens": 2}


def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_full_queue_answers_429_with_retry_after(stub_app):
    app, engine = stub_app(server={"queue_size": 1})
    engine.gate.clear()  # the first query holds the worker
    with TestClient(app) as client, ThreadPoolExecutor(2) as pool:
        running = pool.submit(client.post, "/v1/query", json=QUERY)
        assert engine.started.acquire(timeout=10)
        waiting = pool.submit(client.post, "/v1/query", json=QUERY)
        wait_until(lambda: app.state.service.waiting == 1)

        refused = client.post("/v1/query", json=QUERY)
        assert refused.status_code == 429
        assert int(refused.headers["Retry-After"]) >= 1
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert refused.json()["error"]["code"] == "queue_full"
        assert "ragblend:num_requests_waiting 1.0" in client.get("/metrics").text

        engine.gate.set()
        assert running.result(10).status_code == 200
        assert waiting.result(10).status_code == 200
    assert engine.calls == 2


def test_queue_wait_past_timeout_answers_503_and_never_runs(stub_app):
    app, engine = stub_app(server={"request_timeout_s": 0.3})
    engine.gate.clear()
    with TestClient(app) as client, ThreadPoolExecutor(1) as pool:
        running = pool.submit(client.post, "/v1/query", json=QUERY)
        assert engine.started.acquire(timeout=10)
        timed_out = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert timed_out.status_code == 503
        assert timed_out.json()["error"]["code"] == "queue_timeout"
        assert int(timed_out.headers["Retry-After"]) >= 1
        engine.gate.set()
        assert running.result(10).status_code == 200
        wait_until(lambda: app.state.service.waiting == 0)
    assert engine.calls == 1


@pytest.mark.parametrize("max_batch", [1, 3])
def test_at_most_max_batch_requests_in_flight(stub_app, max_batch):
    """Requests that hand the model thread back between tokens interleave, up to max_batch at a time."""
    app, engine = stub_app(step_s=0.01, server={"max_batch": max_batch})
    body = {**QUERY, "max_tokens": 6}
    with TestClient(app) as client, ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(lambda _: client.post("/v1/query", json=body), range(6)))
    assert [r.status_code for r in responses] == [200] * 6
    assert all(r.json()["answer"] == "ok ok ok ok ok ok" for r in responses)
    assert engine.peak == max_batch and max(engine.batches) == max_batch


def test_client_disconnect_stops_generation(stub_app, serve_live):
    app, engine = stub_app(step_s=0.02)
    with serve_live(app) as live, httpx.Client(base_url=live.url, timeout=10) as http:
        body = {"question": "long?", "max_tokens": 500, "stream": True}  # ~10 s if never stopped
        with http.stream("POST", "/v1/query", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data:"):
                    break  # first delta arrived: hang up
        assert engine.cancelled.wait(5), "generation kept running after the client left"
        assert engine.emitted < 500
        # The worker is free again at once.
        assert http.post("/v1/query", json=QUERY).status_code == 200


def test_health_is_503_while_loading_then_200(monkeypatch, stub_settings, stub_engine_type):
    gate = threading.Event()

    def slow_engine(settings, parts):
        assert gate.wait(10)
        return stub_engine_type(settings)

    monkeypatch.setattr(server, "RagEngine", slow_engine)
    with TestClient(server.create_app(stub_settings)) as client:
        loading = client.get("/health")
        assert loading.status_code == 503 and loading.json()["status"] == "loading"
        blocked = client.post("/v1/query", json=QUERY)
        assert blocked.status_code == 503 and blocked.json()["error"]["code"] == "loading"
        gate.set()
        wait_until(lambda: client.get("/health").status_code == 200)
        health = client.get("/health").json()
        assert (health["status"], health["model"], health["model_thread"]["alive"]) == ("ok", "stub", True)
        assert client.post("/v1/query", json=QUERY).status_code == 200


def test_health_reports_a_failed_load(monkeypatch, stub_settings):
    def broken(settings, parts):
        raise FileNotFoundError("no model here")

    monkeypatch.setattr(server, "RagEngine", broken)
    with TestClient(server.create_app(stub_settings)) as client:
        wait_until(lambda: client.get("/health").json()["status"] == "error")
        health = client.get("/health")
        assert health.status_code == 503 and "no model here" in health.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_usage_and_metrics_from_stub(stub_app, stream):
    app, _ = stub_app()
    with TestClient(app) as client:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": stream,
                "stream_options": {"include_usage": True}}
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200
        metrics = client.get("/metrics").text
    assert 'ragblend:http_requests_total{endpoint="/v1/chat/completions",status="200",tenant="default"} 1.0' in metrics
    assert "ragblend:prompt_tokens_total 10.0" in metrics
    assert 'ragblend:time_to_first_token_seconds_count{mode="blend"} 1.0' in metrics


def test_non_streaming_client_that_leaves_frees_its_slot(stub_app, serve_live):
    """A plain (non-SSE) request whose client disconnects is cancelled too: its slot frees at once."""
    app, engine = stub_app(step_s=0.02, server={"max_batch": 1})
    with serve_live(app) as live:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{live.url}/v1/query", json={"question": "long?", "max_tokens": 500}, timeout=0.5)
        assert engine.cancelled.wait(5), "generation kept running after the client left"
        assert engine.emitted < 500
        wait_until(lambda: app.state.service.running == 0)
        assert httpx.post(f"{live.url}/v1/query", json=QUERY, timeout=10).status_code == 200


def test_health_is_503_while_the_model_thread_is_stuck(stub_app):
    app, engine = stub_app(server={"stuck_after_s": 0.3})
    engine.gate.clear()  # the query holds the model thread inside one step
    with TestClient(app) as client, ThreadPoolExecutor(1) as pool:
        assert client.get("/health").status_code == 200
        running = pool.submit(client.post, "/v1/query", json=QUERY)
        assert engine.started.acquire(timeout=10)
        wait_until(lambda: client.get("/health").status_code == 503)
        health = client.get("/health").json()
        assert health["status"] == "stuck" and health["error"]["code"] == "stuck"
        thread = health["model_thread"]
        assert thread["alive"] and thread["active_slots"] == 1 and thread["current"]["age_s"] > 0.3
        assert thread["current"]["work"] == "request query"
        assert client.get("/health/live").status_code == 503  # a restart would help
        assert client.get("/health/ready").status_code == 503
        engine.gate.set()
        assert running.result(10).status_code == 200
        wait_until(lambda: client.get("/health").status_code == 200)
        assert client.get("/health/live").status_code == 200 and client.get("/health/ready").status_code == 200
        assert client.get("/health").json()["model_thread"]["current"] is None


def test_health_is_degraded_while_a_request_waits_past_the_bound(stub_app):
    app, engine = stub_app(server={"degraded_wait_s": 0.3, "max_batch": 1})
    engine.gate.clear()  # the first query holds the one slot; the second waits in the queue
    with TestClient(app) as client, ThreadPoolExecutor(2) as pool:
        running = [pool.submit(client.post, "/v1/query", json=QUERY) for _ in range(2)]
        assert engine.started.acquire(timeout=10)
        wait_until(lambda: client.get("/health").json()["status"] == "degraded")
        health = client.get("/health")
        assert health.status_code == 200 and "waited" in health.json()["degraded"][0]  # still answering
        assert health.json()["model_thread"]["oldest_wait_s"] > 0.3
        engine.gate.set()
        assert [r.result(10).status_code for r in running] == [200, 200]
        wait_until(lambda: client.get("/health").json()["status"] == "ok")


def test_health_paths_need_no_api_key(stub_app):
    app, _ = stub_app(server={"api_key": "k"})
    with TestClient(app) as client:
        for path in ("/health", "/health/live", "/health/ready"):
            assert client.get(path).status_code == 200, path
        assert client.get("/v1/models").status_code == 401


def test_health_shows_what_kind_of_work_runs_never_a_clients_text(stub_app):
    """/health is open to anyone (probes): it says a query or a chat runs and for how long, not what it asks."""
    app, engine = stub_app(server={"api_key": "k"})
    engine.gate.clear()
    secret = "What is the door code of the Kestrel Bakery?"
    key = {"Authorization": "Bearer k"}
    with TestClient(app) as client, ThreadPoolExecutor(2) as pool:
        for path, body, kind in [("/v1/query", {"question": secret, "max_tokens": 1}, "query"),
                                 ("/v1/chat/completions", {"messages": [{"role": "user", "content": secret}],
                                                           "max_tokens": 1}, "chat")]:
            running = pool.submit(client.post, path, json=body, headers=key)
            assert engine.started.acquire(timeout=10)
            health = client.get("/health")
            assert "Kestrel" not in health.text and "door code" not in health.text
            current = health.json()["model_thread"]["current"]
            assert current["work"] == f"request {kind}" and current["age_s"] >= 0
            engine.gate.set()
            assert running.result(10).status_code == 200
            engine.gate.clear()


def test_every_503_says_when_to_retry(stub_app):
    """Loading, the queue timeout (above) and shutting down: each 503 has a Retry-After."""
    app, engine = stub_app()
    with TestClient(app) as client:
        app.state.service.begin_shutdown()
        for method, path, body in [("POST", "/v1/query", QUERY), ("GET", "/v1/models", None),
                                   ("POST", "/v1/documents", {"text": "t"})]:
            refused = client.request(method, path, json=body)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down", refused.text
            assert int(refused.headers["Retry-After"]) >= 1
