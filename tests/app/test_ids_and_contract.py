"""Ids and the contract on the real engine: an id with an invisible or private-use character is refused wherever
the API takes one (a look-alike of another id would be), and normalised otherwise; a 422 names the field and the
rule, never pydantic's internals; a JSON Schema of `true` is a schema; `/openapi.json` states the model's own
sizes once it has loaded."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tests.helpers import MODEL

pytestmark = pytest.mark.slow
HI = [{"role": "user", "content": "hi"}]
INVISIBLE = ["\u200b", "\ufeff", "\u2060", "\u00ad", "\U000e0041", "\U000f0001"]


@pytest.mark.parametrize("char", INVISIBLE)
def test_an_id_with_an_invisible_character_is_refused(client, char):
    doc = client.post("/v1/documents", json={"id": f"note{char}1", "text": "A note."})
    assert doc.status_code == 422 and doc.json()["error"]["param"] == "id", doc.text
    assert "invisible" in doc.json()["error"]["message"]
    chat = client.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 1,
                                                     "prompt_cache_key": f"app{char}"})
    assert chat.status_code == 422 and chat.json()["error"]["param"] == "prompt_cache_key"
    call = [{"role": "user", "content": "hi"},
            {"role": "assistant", "tool_calls": [{"id": f"c{char}1", "type": "function",
                                                  "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}, {"role": "user", "content": "and?"}]
    assert client.post("/v1/chat/completions", json={"model": MODEL, "messages": call}).status_code == 422
    blocks = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{char}", "content": "x"}]}]
    anthropic = client.post("/v1/messages", json={"model": MODEL, "max_tokens": 1, "messages": blocks})
    assert anthropic.status_code == 400 and "tool_use_id" in anthropic.json()["error"]["message"]


def test_a_document_id_is_one_id_in_either_normal_form(client):
    nfd = "cafe\u0301-menu"
    assert client.post("/v1/documents", json={"id": nfd, "text": "Coffee is served until noon."}).status_code == 201
    try:
        assert client.get("/v1/documents/caf\u00e9-menu").status_code == 200  # NFC: the same id
    finally:
        assert client.delete("/v1/documents/caf\u00e9-menu").status_code == 200


def test_a_422_names_the_field_and_the_rule_not_internals(client):
    body = client.post("/v1/completions", json={"model": MODEL, "prompt": [-1]}).json()["error"]
    assert body["param"] == "prompt.0" and "greater than or equal to 0" in body["message"]
    assert not any(internal in body["message"] for internal in ("function-after", "0x", "partial", "[", "<"))


def test_a_schema_of_true_is_a_schema(client):
    answer = client.post("/v1/chat/completions", json={
        "model": f"{MODEL}-chat", "messages": HI, "max_tokens": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "any", "schema": True}}})
    assert answer.status_code == 200, answer.text
    refused = client.post("/v1/chat/completions", json={
        "model": f"{MODEL}-chat", "messages": HI, "max_tokens": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "none", "schema": False}}})
    assert refused.status_code == 422 and "false admits no value" in refused.json()["error"]["message"]
    tools = [{"name": "anything", "input_schema": True}]
    assert client.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": HI,
                                                          "tools": tools}).status_code == 200


def test_the_schema_states_the_loaded_models_sizes(client, server_engine):
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    ids = next(s for s in schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
               if s.get("items", {}).get("type") == "integer")
    assert ids["items"]["maximum"] == server_engine.parts.runtime.vocab - 1
    dims = schemas["EmbeddingRequest"]["properties"]["dimensions"]["anyOf"]
    assert {"type": "integer", "minimum": 1, "enum": [384]}.items() <= next(d for d in dims if "enum" in d).items()
    text_part = schemas["TextPart"]["properties"]["type"]
    assert text_part["const"] == "text"
    chat = schemas["ChatCompletionRequest"]
    assert chat["then"]["properties"]["logprobs"] == {"const": True}  # top_logprobs needs logprobs: true


def test_warm_up_runs_a_first_requests_paths_before_ready(make_app, corpus):
    """With server.warm_up, the app is ready only after requests ran on the model thread: decode steps were
    taken before any client's request, and the first client's answer is a normal one."""
    app = make_app(server={"warm_up": True})
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        assert sum(n for n, _ in app.state.service.scheduler.step_totals().values()) >= 4  # before any request
        counted = [line for line in client.get("/metrics").text.splitlines()
                   if line.startswith("ragblend:http_requests_total{") and 'endpoint="/health"' not in line]
        assert counted == []  # no client's request yet: the warm-up's are not counted as requests
        answer = client.post("/v1/query", json={"question": corpus.questions[0][0], "max_tokens": 2})
        assert answer.status_code == 200 and answer.json()["answer"]
