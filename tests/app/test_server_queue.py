"""The worker queue's contract, on a stub engine whose timing the test controls: one job at a time,
429 when the queue is full, 503 after the queue timeout, a disconnect stops generation, and
/health answers 503 while the engine loads."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fastapi.testclient import TestClient

import app.server as server

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
        wait_until(lambda: app.state.service.worker.waiting == 1)

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
        engine.gate.set()
        assert running.result(10).status_code == 200
        wait_until(lambda: app.state.service.worker.waiting == 0)
    assert engine.calls == 1


def test_jobs_run_one_at_a_time(stub_app):
    app, engine = stub_app(step_s=0.01)
    active, peak, lock = 0, 0, threading.Lock()
    stream = engine.stream

    def counting(params, cancelled):
        nonlocal active, peak
        with lock:
            active += 1
            peak = max(peak, active)
        try:
            yield from stream(params, cancelled)
        finally:
            with lock:
                active -= 1

    engine.stream = counting
    with TestClient(app) as client, ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(lambda _: client.post("/v1/query", json=QUERY).status_code, range(6)))
    assert codes == [200] * 6 and peak == 1


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

    def slow_engine(settings):
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
        assert client.get("/health").json() == {"status": "ok", "model": "stub"}
        assert client.post("/v1/query", json=QUERY).status_code == 200


def test_health_reports_a_failed_load(monkeypatch, stub_settings):
    def broken(settings):
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
    assert 'ragblend:http_requests_total{endpoint="/v1/chat/completions",status="200"} 1.0' in metrics
    assert "ragblend:prompt_tokens_total 10.0" in metrics
    assert 'ragblend:time_to_first_token_seconds_count{mode="blend"} 1.0' in metrics
