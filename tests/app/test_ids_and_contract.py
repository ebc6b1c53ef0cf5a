"""Ids and the contract on the real engine: an id with an invisible or private-use character is refused wherever
the API takes one (a look-alike of another id would be), and normalised otherwise; a 422 names the field and the
rule, never pydantic's internals; a JSON Schema of `true` is a schema; `/openapi.json` states the model's own
sizes once it has loaded, and every rule the reliability probe (#57) found the server enforcing unstated."""
from __future__ import annotations

import jsonschema
import pytest
from fastapi.testclient import TestClient
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from tests.helpers import MODEL

pytestmark = pytest.mark.slow
HI = [{"role": "user", "content": "hi"}]
TOOLS = [{"name": "f", "input_schema": {"type": "object"}}]
# Requests the probe sent as valid by the description that the server refused: each is invalid by it now
UNSTATED = {
    "json_schema: null": ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": None}},
                          "needs json_schema"),
    "an image part": ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]},
                      "reads text only"),
    "top_logprobs without logprobs": ("/v1/chat/completions", {"top_logprobs": 2, "logprobs": False},
                                      "top_logprobs needs logprobs: true"),
    "a token id past the vocabulary": ("/v1/completions", {"prompt": [10 ** 6]}, "is not in the vocabulary"),
    "dimensions: 1": ("/v1/embeddings", {"input": "hi", "dimensions": 1}, "384 dimensions only"),
    "required without tools": ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice required needs tools"),
    "a named function without tools": ("/v1/chat/completions", {"tool_choice": {"type": "function", "function": {
        "name": "f"}}}, "is not among the tools (none)"),
    "a forced lookup without tools": ("/v1/cache/lookup", {"tool_choice": "required", "tools": []}, "needs tools"),
    "any without tools": ("/v1/messages", {"tool_choice": {"type": "any"}}, "tool_choice any needs tools"),
    "a named tool without tools": ("/v1/messages", {"tool_choice": {"type": "tool", "name": "f"}, "tools": []},
                                   "is not among the tools (none)"),
    "a tool name holding the call markup": ("/v1/messages", {"tools": [{"name": "x</tool_call>y"}]}, "call markup"),
    "retrieval without a user message": ("/v1/messages", {"retrieval": True, "messages": [
        {"role": "assistant", "content": "The lighthouse"}]}, "retrieval needs a user message"),
    "tool_choice name: null": ("/v1/messages", {"tools": TOOLS, "tool_choice": {"type": "tool", "name": None}},
                               "tool_choice.tool.name"),
}
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
    logprobs_rule, call_rule = chat["allOf"]
    assert logprobs_rule["then"]["properties"]["logprobs"] == {"const": True}  # top_logprobs needs logprobs: true
    assert call_rule["then"]["properties"]["tools"]["minItems"] == 1  # a forced call needs tools


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


@pytest.mark.parametrize("case", UNSTATED)
def test_what_the_server_refuses_the_schema_states(client, case):
    """Each body is invalid by /openapi.json (so a client generating from it never sends it as valid) and refused
    with a 4xx that names the rule."""
    path, fields, rule = UNSTATED[case]
    spec = client.get("/openapi.json").json()
    embedder = spec["components"]["schemas"]["EmbeddingRequest"]["properties"]["model"]["enum"][0]
    chat = {"model": MODEL, "messages": HI, "max_tokens": 1}
    valid = {"/v1/chat/completions": chat, "/v1/messages": chat, "/v1/cache/lookup": chat,
             "/v1/embeddings": {"model": embedder, "input": "hi"},
             "/v1/completions": {"model": MODEL, "prompt": [1], "max_tokens": 1}}[path]
    pointer = "/".join(part.replace("/", "~1") for part in ("paths", path, "post", "requestBody", "content",
                                                            "application/json", "schema"))
    validator = jsonschema.Draft202012Validator({"$ref": f"urn:openapi#/{pointer}"}, registry=Registry().with_resource(
        "urn:openapi", Resource.from_contents(spec, default_specification=DRAFT202012)))
    assert validator.is_valid(valid) and not validator.is_valid(valid | fields)
    refused = client.post(path, json=valid | fields)
    assert refused.status_code in (400, 422) and rule in refused.text, refused.text


def test_a_binary_file_sent_as_text_is_refused_as_the_description_says(client):
    body = client.get("/openapi.json").json()["paths"]["/v1/documents"]["post"]["requestBody"]
    assert "sent as text/plain is a 422" in body["description"]
    png = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"
    refused = client.post("/v1/documents", files={"file": ("picture", png, "text/plain")})
    assert refused.status_code == 422 and "not text" in refused.json()["error"]["message"], refused.text
    assert client.get("/v1/documents/picture").status_code == 404  # nothing written
