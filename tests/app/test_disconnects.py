"""A client that leaves is a clean cancel, and refusals are logged: on a real uvicorn server (a stub engine where
the test must hold the model thread at a chosen point), with httpx clients that hang up early. A disconnect before
the first token (streamed or not) is counted as 499 (nginx's "client closed request") in /metrics, never a 500,
and logs one INFO line and no traceback; each refused request's reason is logged at WARNING, once per reason in
a while."""
from __future__ import annotations

import logging
import time

import httpx
import pytest
from fastapi.testclient import TestClient

QUERY = {"question": "anything?", "max_tokens": 2}


def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def counted(metrics: str, path: str) -> dict[str, float]:
    """status -> requests of `path` in /metrics."""
    prefix = f'ragblend:http_requests_total{{endpoint="{path}",status="'
    return {line[len(prefix):].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines() if line.startswith(prefix)}


def tracebacks(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/query", QUERY), ("/v1/query", {**QUERY, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}),
    ("/v1/messages", {"model": "stub", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})])
def test_a_client_gone_before_its_first_token_is_a_clean_cancel(stub_app, serve_live, caplog, path, body):
    app, engine = stub_app(server={"step_token_budget": 1})  # its prompt and its first token: two steps
    engine.gate.clear()  # the request holds the model thread before its first token
    caplog.set_level(logging.INFO, logger="ragblend")
    with serve_live(app) as live:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(live.url + path, json=body, timeout=0.5)
        assert engine.started.acquire(timeout=10)
        svc = app.state.service
        wait_until(lambda: all(slot.job.cancelled.is_set() for slot in svc.scheduler._slots))  # the server noticed
        engine.gate.set()  # the next step sees its cancel before any token
        wait_until(lambda: "499" in counted(svc.metrics.render().decode(), path))
        statuses = counted(svc.metrics.render().decode(), path)
        assert engine.cancelled.is_set() and engine.emitted == 0
        assert httpx.post(live.url + "/v1/query", json=QUERY, timeout=10).status_code == 200  # the slot is free
    assert statuses == {"499": 1.0}, statuses
    assert not tracebacks(caplog)
    gone = [r for r in caplog.records if r.getMessage() == "client disconnected"]
    assert [(r.levelno, r.path) for r in gone] == [(logging.INFO, path)]


def test_a_client_gone_mid_stream_is_one_info_line(stub_app, serve_live, caplog):
    app, engine = stub_app(step_s=0.02)  # a decode step a token, through the real scheduler and runner
    caplog.set_level(logging.INFO, logger="ragblend")
    with serve_live(app) as live, httpx.Client(base_url=live.url, timeout=10) as http:
        with http.stream("POST", "/v1/query", json={"question": "long?", "max_tokens": 500, "stream": True}) as r:
            assert r.status_code == 200
            next(line for line in r.iter_lines() if line.startswith("data:"))  # the first delta: hang up
        assert engine.cancelled.wait(5)
        wait_until(lambda: any(r.getMessage() == "client disconnected" for r in caplog.records))
        statuses = counted(app.state.service.metrics.render().decode(), "/v1/query")
    assert "500" not in statuses and not tracebacks(caplog)
    assert sum(r.getMessage() == "client disconnected" for r in caplog.records) == 1


def test_each_refusal_is_logged_once_with_its_reason(stub_app, caplog):
    """At the default level (WARNING): a refused request's status, code and reason; the same refusal again at
    once is counted into the next line rather than logged; another reason is logged at once."""
    app, _ = stub_app(server={"api_key": "k"})
    caplog.set_level(logging.WARNING, logger="ragblend")
    auth = {"Authorization": "Bearer k"}
    with TestClient(app) as client:
        for _ in range(3):
            assert client.post("/v1/query", json={"question": ""}, headers=auth).status_code == 422
        assert client.post("/v1/query", json=QUERY).status_code == 401  # no key: refused by the middleware
    refused = [r for r in caplog.records if r.getMessage() == "refused"]
    assert [(r.status, r.code) for r in refused] == [(422, "invalid_value"), (401, "invalid_api_key")]
    assert "question" in refused[0].reason and "API key" in refused[1].reason
