"""The HTTP API end to end on the real embedded model (SmolLM2-135M, CPU) and a four-document corpus
ingested through POST /v1/documents: answers and sources, blend vs full, SSE streaming, documents,
limits and bad input, auth, concurrency and metrics."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fastapi.testclient import TestClient

pytestmark = pytest.mark.slow


def sse_events(response: httpx.Response) -> list[tuple[str, str]]:
    """(event name, data) pairs of a server-sent event stream."""
    events, name = [], "message"
    for line in response.iter_lines():
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            events.append((name, line[5:].strip()))
            name = "message"
    return events


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "code", "param"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    if status == 422 and param not in (None, "body"):  # the message names the field too
        assert param in error["message"], error
    return error


# ---- basics ------------------------------------------------------------------------------------

def test_health_and_models(client):
    health = client.get("/health").json()
    assert (health["status"], health["model"]) == ("ok", "smollm2-135m-instruct")
    thread = health["model_thread"]
    assert thread["alive"] and thread["queue_depth"] == 0 and thread["active_slots"] == 0
    assert thread["max_batch"] == 8 and "blend_disabled" not in health  # SmolLM2 blends
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["smollm2-135m-instruct"]


# ---- queries -----------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["full", "blend"])
def test_query_answers_from_the_right_passage(client, corpus, mode):
    question, doc_id, words = corpus.questions[0]
    body = {"question": question, "mode": mode, "top_k": 1, "max_tokens": 14}
    response = client.post("/v1/query", json=body)
    assert response.status_code == 200, response.text
    body = response.json()
    assert any(w in body["answer"] for w in words), body["answer"]
    [source] = body["sources"]
    assert source["doc_id"] == doc_id and source["title"] == corpus.docs[doc_id][0] and words[0] in source["text"]

    stats = body["stats"]
    assert stats["mode"] == mode and 0 < stats["ttft_ms"] <= stats["total_ms"]
    assert 0 < stats["completion_tokens"] <= 14
    if mode == "full":
        assert stats["cached_tokens"] == 0 and stats["recompute_ratio"] == 1.0
    else:  # head + one passage precomputed after it: an exact prefix, read from the store
        assert 0 < stats["cached_tokens"] < stats["prompt_tokens"]
        assert stats["store_hits"] == {"memory": 1}


def test_query_stream_blends_two_passages(client, corpus):
    question, doc_id, _ = corpus.questions[1]
    body = {"question": question, "stream": True, "max_tokens": 6, "top_k": 2, "recompute_ratio": 0.3}
    with client.stream("POST", "/v1/query", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    names = [name for name, _ in events]
    assert names[-1] == "result" and set(names[:-1]) == {"delta"} and len(names) >= 2
    result = json.loads(events[-1][1])
    assert "".join(json.loads(data)["delta"] for _, data in events[:-1]).strip() == result["answer"]
    assert result["sources"][0]["doc_id"] == doc_id and len(result["sources"]) == 2
    stats = result["stats"]
    # The second passage sits after a different neighbour than at ingest: some of it is recomputed.
    assert stats["mode"] == "blend" and stats["recompute_ratio"] == 0.3 and stats["ttft_ms"] > 0
    assert 0 < stats["recomputed_tokens"] < stats["cached_tokens"] < stats["prompt_tokens"]
    assert stats["selection"] == "query"  # blend.selection


@pytest.mark.parametrize("selection", ["hkvd", "random"])
def test_query_selection_per_request(client, corpus, selection):
    question = corpus.questions[1][0]
    body = {"question": question, "max_tokens": 2, "top_k": 2, "recompute_ratio": 0.3, "selection": selection}
    response = client.post("/v1/query", json=body)
    assert response.status_code == 200, response.text
    stats = response.json()["stats"]
    assert stats["selection"] == selection and 0 < stats["recomputed_tokens"] < stats["cached_tokens"]


def test_chat_completion_shape_and_usage(client, corpus):
    question, doc_id, words = corpus.questions[0]
    response = client.post("/v1/chat/completions", json={
        "model": "whatever", "messages": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": question}],
        "max_tokens": 14, "temperature": 0, "user": "u1", "logit_bias": {}, "unknown_extra": True, "top_k": 1})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == "smollm2-135m-instruct" and isinstance(body["created"], int)
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and any(w in choice["message"]["content"] for w in words)
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == usage["total_tokens"]
    assert 0 < usage["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"]
    assert body["sources"][0]["doc_id"] == doc_id


# ---- documents ---------------------------------------------------------------------------------

def test_documents_list_get_upload_delete(client, corpus):
    listed = {d["id"]: d for d in client.get("/v1/documents").json()["data"]}
    assert set(corpus.docs) <= set(listed)
    assert client.get("/v1/documents/harbor").json()["title"] == corpus.docs["harbor"][0]
    assert corpus.ingested["harbor"]["status"] == "added" and corpus.ingested["harbor"]["n_chunks"] == 1

    # Posting the same document again changes nothing.
    title, text = corpus.docs["harbor"]
    again = client.post("/v1/documents", json={"id": "harbor", "title": title, "text": text})
    assert again.status_code == 201 and again.json()["data"][0]["status"] == "unchanged"

    # A Markdown upload: the first heading becomes the title, the file stem the id.
    upload = client.post("/v1/documents", files={"file": ("glacier-note.md", b"# Fenwick Glacier\n\nThe Fenwick "
                                                          b"Glacier retreated 40 metres in 2021.\n", "text/markdown")})
    assert upload.status_code == 201, upload.text
    doc = upload.json()["data"][0]
    assert (doc["id"], doc["title"], doc["status"]) == ("glacier-note", "Fenwick Glacier", "added")

    # A JSONL upload holds several documents; an id given in the form prefixes lines without one.
    lines = b'{"id": "j1", "text": "First line document about owls."}\n{"text": "Second about moths."}\n'
    jsonl = client.post("/v1/documents", files={"file": ("batch.jsonl", lines)}, data={"id": "batch"})
    assert jsonl.status_code == 201, jsonl.text
    assert [d["id"] for d in jsonl.json()["data"]] == ["j1", "batch:2"]

    for doc_id in ("glacier-note", "j1", "batch:2"):
        deleted = client.delete(f"/v1/documents/{doc_id}")
        assert deleted.status_code == 200 and deleted.json() == {"id": doc_id, "object": "document", "deleted": True}
    assert_error(client.delete("/v1/documents/glacier-note"), 404, "doc_id")
    assert_error(client.get("/v1/documents/glacier-note"), 404, "doc_id")
    assert set(d["id"] for d in client.get("/v1/documents").json()["data"]) == set(listed)


def test_bad_upload_leaves_nothing_behind(client):
    before = client.get("/v1/documents").json()["data"]
    # One good line and one malformed line: the whole file is refused before anything is written.
    lines = b'{"id": "good", "text": "fine"}\n{"id": "bad", "text": 5}\n'
    assert_error(client.post("/v1/documents", files={"file": ("mixed.jsonl", lines)}), 422, "file")
    assert_error(client.post("/v1/documents", files={"file": ("x.pdf", b"%PDF")}), 422, "file")
    assert_error(client.post("/v1/documents", files={"file": ("x.txt", b"\xff\xfe\x00bin")}), 422, "file")
    assert_error(client.post("/v1/documents", files={"file": ("blank.txt", b"  \n ")}), 422)
    assert_error(client.post("/v1/documents", files={"other": ("x.txt", b"text")}), 422, "file")
    assert client.get("/v1/documents").json()["data"] == before


# ---- limits and bad input ----------------------------------------------------------------------

MSG = [{"role": "user", "content": "hi"}]
BAD_INPUTS = [
    ("/v1/query", {}, "question"),
    ("/v1/query", {"question": "   "}, "question"),
    ("/v1/query", {"question": "x" * 2001}, "question"),
    ("/v1/query", {"question": "q", "top_k": 0}, "top_k"),
    ("/v1/query", {"question": "q", "top_k": 17}, "top_k"),
    ("/v1/query", {"question": "q", "max_tokens": 513}, "max_tokens"),
    ("/v1/query", {"question": "q", "max_tokens": 0}, "max_tokens"),
    ("/v1/query", {"question": "q", "recompute_ratio": 1.5}, "recompute_ratio"),
    ("/v1/query", {"question": "q", "recompute_ratio": -0.1}, "recompute_ratio"),
    ("/v1/query", {"question": "q", "mode": "fast"}, "mode"),
    ("/v1/query", {"question": "q", "selection": "best"}, "selection"),
    ("/v1/query", {"question": "q", "temperature": "hot"}, "temperature"),
    ("/v1/query", {"question": "q", "topk": 3}, "topk"),
    ("/v1/query", ["question"], "body"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "only me"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": MSG, "n": 2}, "n"),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 10_000}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": 10_000}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/chat/completions", {"messages": MSG, "recompute_ratio": 2}, "recompute_ratio"),
    ("/v1/chat/completions", {"messages": MSG, "seed": -1}, "seed"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 2001}]}, "messages"),
    ("/v1/documents", {"title": "no text"}, "text"),
    ("/v1/documents", {"text": " \n "}, "text"),
    ("/v1/documents", {"id": "", "text": "t"}, "id"),
    ("/v1/documents", {"text": "t", "extra": 1}, "extra"),
    ("/v1/documents", {"id": "a\x00b", "text": "t"}, "id"),
    ("/v1/documents", {"title": "\x1b[31mred", "text": "t"}, "title"),
    ("/v1/query", {"question": "q", "max_tokens": True}, "max_tokens"),  # strict types: no bool for an int
    ("/v1/query", {"question": "q", "stream": "yes"}, "stream"),         # ... and no string for a bool
    ("/v1/query", {"question": "q", "top_k": 2.0}, "top_k"),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": True}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "stream": "yes"}, "stream"),
]


@pytest.mark.parametrize("path, body, param", BAD_INPUTS, ids=[f"{p}:{f}" for p, _, f in BAD_INPUTS])
def test_bad_input_is_422_naming_the_field(client, path, body, param):
    error = assert_error(client.post(path, json=body), 422, param)
    assert error["type"] == "invalid_request_error"


SURROGATE = [  # JSON may escape a lone surrogate; no tokenizer can read one
    ("/v1/query", b'{"question": "light\\ud800house"}', "question"),
    ("/v1/query", b'{"question": "light\\ud800house", "stream": true}', "question"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "light\\ud800house"}]}', "messages.0.content"),
    ("/v1/chat/completions", b'{"stream": true, "messages": [{"role": "user", "content": "light\\ud800house"}]}',
     "messages.0.content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
     "messages.0.content"),
    ("/v1/documents", b'{"text": "light\\ud800house"}', "text"),
]


@pytest.mark.parametrize("path, body, param", SURROGATE, ids=[f"{p}:{i}" for i, (p, _, _) in enumerate(SURROGATE)])
def test_invalid_unicode_is_422_on_every_endpoint(client, path, body, param):
    error = assert_error(client.post(path, content=body, headers={"content-type": "application/json"}), 422)
    assert error["param"].startswith(param) and "unicode" in error["message"].lower(), error


def test_multipart_ids_and_titles_pass_the_json_checks(client):
    before = client.get("/v1/documents").json()["data"]
    upload = {"file": ("note.txt", b"The ferry leaves at nine.")}
    assert_error(client.post("/v1/documents", files=upload, data={"id": "a\x00b"}), 422, "id")
    assert_error(client.post("/v1/documents", files=upload, data={"title": "\x1b[2Jwiped"}), 422, "title")
    assert_error(client.post("/v1/documents", files=upload, data={"id": "x" * 257}), 422, "id")
    lines = b'{"id": "bad\\nid", "text": "t"}\n'  # ids inside a JSONL file too
    assert "control characters" in assert_error(client.post("/v1/documents", files={"file": ("d.jsonl", lines)}),
                                                 422, "file")["message"]
    assert client.get("/v1/documents").json()["data"] == before


def test_unparseable_bodies_use_the_error_shape(client):
    deep = b"[" * 100_000 + b"]" * 100_000
    for path in ("/v1/query", "/v1/documents"):
        error = assert_error(client.post(path, content=deep, headers={"content-type": "application/json"}), 422)
        assert error["code"] and error["param"] == "body"
    no_boundary = client.post("/v1/documents", content=b"--x\r\n", headers={"content-type": "multipart/form-data"})
    assert assert_error(no_boundary, 422)["code"] == "invalid_body"


def test_a_document_over_the_size_limit_is_413_and_changes_nothing(engine_with, corpus):
    from app.server import create_app

    settings, engine = engine_with(limits={"max_document_chars": 1000})
    with TestClient(create_app(settings, engine)) as client:
        before = client.get("/v1/documents").json()["data"]
        error = assert_error(client.post("/v1/documents", json={"id": "big", "text": "a" * 1001}), 413)
        assert error["code"] == "document_too_large" and "1,000" in error["message"]
        upload = client.post("/v1/documents", files={"file": ("big.txt", b"a" * 1001)})
        assert assert_error(upload, 413)["code"] == "document_too_large"
        assert client.get("/v1/documents").json()["data"] == before
    engine.parts.close()


def test_every_error_has_a_code(client):
    for response in (client.get("/v1/nothing"), client.put("/v1/query", json={}),
                     client.post("/v1/query", json={"question": "q", "top_k": 99})):
        assert response.json()["error"]["code"], response.text


@pytest.mark.parametrize("path", ["/v1/query", "/v1/chat/completions", "/v1/documents"])
def test_invalid_json_is_422(client, path):
    response = client.post(path, content=b'{"question": ', headers={"content-type": "application/json"})
    assert "invalid JSON" in assert_error(response, 422, "body")["message"]


def test_unknown_route_and_method_use_the_error_shape(client):
    assert assert_error(client.get("/v1/nothing"), 404)["type"] == "not_found_error"
    assert_error(client.put("/v1/query", json={}), 405)
    assert_error(client.post("/v1/documents", content=b"text", headers={"content-type": "text/plain"}), 415)


def test_prompt_over_the_context_is_400(make_app, corpus):
    with TestClient(make_app(limits={"max_new_tokens": 9000})) as client:
        error = assert_error(client.post("/v1/query", json={"question": "q", "max_tokens": 9000}), 400)
    assert "context" in error["message"]


def test_body_over_the_limit_is_413(make_app, corpus, serve_live):
    app = make_app(limits={"max_body_bytes": 1000})
    big = {"question": "x" * 2000}
    with TestClient(app) as client:
        assert assert_error(client.post("/v1/query", json=big), 413)["code"] == "payload_too_large"
        upload = client.post("/v1/documents", files={"file": ("big.txt", b"word " * 400)})
        assert_error(upload, 413)
    # Without Content-Length (chunked), the stream is cut as soon as it passes the limit.
    with serve_live(app) as live:
        chunks = (b"x" * 400 for _ in range(100))
        response = httpx.post(f"{live.url}/v1/query", content=chunks, headers={"content-type": "application/json"})
        assert_error(response, 413)


# ---- auth --------------------------------------------------------------------------------------

def test_api_key_guards_everything_but_health(make_app, corpus):
    with TestClient(make_app(server={"api_key": "s3cret"})) as client:
        assert client.get("/health").status_code == 200
        for method, path in [("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/v1/documents"),
                             ("POST", "/v1/query"), ("POST", "/v1/chat/completions"), ("DELETE", "/v1/documents/x"),
                             ("GET", "/openapi.json")]:
            missing = client.request(method, path)
            assert assert_error(missing, 401)["type"] == "authentication_error"
            assert missing.headers["WWW-Authenticate"] == "Bearer"
            assert_error(client.request(method, path, headers={"Authorization": "Bearer wrong"}), 401)
        good = {"Authorization": "Bearer s3cret"}
        assert client.get("/v1/models", headers=good).status_code == 200
        assert client.get("/metrics", headers=good).status_code == 200
        assert_error(client.post("/v1/query", json={}, headers=good), 422)  # past auth, into validation
    with TestClient(make_app()) as open_client:  # no key configured: no auth
        assert open_client.get("/v1/models").status_code == 200


# ---- concurrency and metrics -------------------------------------------------------------------

def test_parallel_clients_all_get_their_answer_and_are_counted(live_server, corpus):
    def metric(text: str, name: str) -> float:
        match = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.MULTILINE)
        return float(match.group(1)) if match else 0.0

    counter = 'ragblend:http_requests_total{endpoint="/v1/query",status="200"}'
    before = httpx.get(f"{live_server.url}/metrics").text

    def ask(item: tuple[str, str, str]) -> tuple[str, dict]:
        question, doc_id, _ = item
        response = httpx.post(f"{live_server.url}/v1/query", timeout=300,
                              json={"question": question, "max_tokens": 6, "top_k": 1})
        assert response.status_code == 200, response.text
        return doc_id, response.json()

    n = len(corpus.questions)
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(ask, corpus.questions))
    for doc_id, body in results:
        assert body["sources"][0]["doc_id"] == doc_id and body["answer"]
    # Four slots of max_batch 8: none waited for another query to finish (they ran interleaved).
    stats = [body["stats"] for _, body in results]
    assert max(s["queue_ms"] for s in stats) < min(s["total_ms"] for s in stats)

    after = httpx.get(f"{live_server.url}/metrics").text
    assert metric(after, counter) - metric(before, counter) == n
    for name in ('ragblend:e2e_request_latency_seconds_count{mode="blend"}',
                 'ragblend:time_to_first_token_seconds_count{mode="blend"}'):
        assert metric(after, name) - metric(before, name) == n
    assert metric(after, "ragblend:prompt_tokens_total") > metric(before, "ragblend:prompt_tokens_total")
    assert metric(after, "ragblend:prompt_tokens_cached_total") > 0
    assert metric(after, 'ragblend:kv_store_hits_total{tier="memory"}') > 0
    # passages are read layer by layer (blend.pipeline): the tier's layer bandwidth is measured
    assert metric(after, 'ragblend:kv_tier_layer_bandwidth_bytes_per_second{tier="memory"}') > 0
    assert metric(after, "ragblend:num_requests_waiting") == 0
