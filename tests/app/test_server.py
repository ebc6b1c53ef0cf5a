"""The HTTP API end to end on the real embedded model (SmolLM2-135M, CPU) and a four-document corpus
ingested through POST /v1/documents: answers and sources, blend vs full, SSE streaming, documents,
limits and bad input, auth, concurrency and metrics."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Iterator

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.helpers import MODEL

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
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [
        "smollm2-135m-instruct", "smollm2-135m-instruct-chat", "all-MiniLM-L6-v2"]  # with retrieval, without; the
    # embedder (POST /v1/embeddings)


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
        "model": MODEL, "messages": [{"role": "system", "content": "Be brief."},
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
    ("/v1/query", {"question": "q", "top_k": 2.5}, "top_k"),  # 2.0 is an integer, as JSON Schema says
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
    from app.api.server import create_app

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

    counter = 'ragblend:http_requests_total{endpoint="/v1/query",status="200",tenant="default"}'
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


# ---- issue #41: no 5xx on any upload, no silent overwrite, bounded work ---------------------------

DEEP_LINE = b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n"


def test_deeply_nested_uploads_are_422_on_both_routes(client):
    before = client.get("/v1/documents").json()["data"]
    deep = b"[" * 100_000 + b"]" * 100_000
    json_upload = client.post("/v1/documents", content=deep, headers={"content-type": "application/json"})
    assert "nested too deeply" in assert_error(json_upload, 422, "body")["message"]
    jsonl = client.post("/v1/documents", files={"file": ("deep.jsonl", b'{"text": "fine"}\n' + DEEP_LINE)})
    assert "deep.jsonl:2: nested too deeply" in assert_error(jsonl, 422, "file")["message"]
    assert client.get("/v1/documents").json()["data"] == before


NOT_UTF8 = b"\xff\xfe"


def multipart(fields: list[tuple[bytes, bytes, bytes | None]]) -> tuple[bytes, dict[str, str]]:
    """A multipart body written byte by byte (no client would send these bytes): (name, value, file name)."""
    parts = []
    for name, value, filename in fields:
        disposition = b'form-data; name="' + name + b'"' + (b'; filename="' + filename + b'"' if filename else b"")
        parts.append(b"--b0undary\r\nContent-Disposition: " + disposition + b"\r\n\r\n" + value + b"\r\n")
    return b"".join(parts) + b"--b0undary--\r\n", {"content-type": "multipart/form-data; boundary=b0undary"}


@pytest.mark.parametrize("where", ["id", "title", "file name", "field name"])
def test_multipart_text_that_is_not_utf8_is_422(client, where):
    """Starlette reads such bytes as Latin-1 (b"\\xff\\xfe" -> "ÿþ"); two uploads could then land on one id."""
    before = client.get("/v1/documents").json()["data"]
    fields = [(b"file", b"The ferry leaves at nine.", b"ferry" + (NOT_UTF8 if where == "file name" else b"") + b".txt")]
    if where in ("id", "title"):
        fields.append((where.encode(), b"note" + NOT_UTF8, None))
    if where == "field name":
        fields.append((b"x" + NOT_UTF8, b"value", None))
    body, headers = multipart(fields)
    error = assert_error(client.post("/v1/documents", content=body, headers=headers), 422)
    assert "UTF-8" in error["message"], error
    assert client.get("/v1/documents").json()["data"] == before


def test_an_upload_never_silently_replaces_another_document(client):
    first = {"id": "ferry-note", "title": "Ferry", "text": "The ferry to Sarne leaves at nine."}
    assert client.post("/v1/documents", json=first).status_code == 201
    try:
        # The same document again: unchanged, whoever sends it.
        again = client.post("/v1/documents", json=first)
        assert again.status_code == 201 and again.json()["data"][0]["status"] == "unchanged"
        # Another text under the same id, JSON or multipart: 409, and the first stays as it was.
        other = {**first, "text": "The ferry to Sarne leaves at ten."}
        conflict = assert_error(client.post("/v1/documents", json=other), 409, "id")
        assert conflict["code"] == "document_exists" and "replace=true" in conflict["message"]
        upload = client.post("/v1/documents", files={"file": ("ferry-note.txt", other["text"].encode())})
        assert assert_error(upload, 409, "id")["code"] == "document_exists"
        batch = b'{"id": "new-one", "text": "A new document."}\n{"id": "ferry-note", "text": "Replaced?"}\n'
        assert_error(client.post("/v1/documents", files={"file": ("batch.jsonl", batch)}), 409, "id")
        assert client.get("/v1/documents/new-one").status_code == 404  # all or none
        hits = client.post("/v1/query", json={"question": "When does the ferry to Sarne leave?", "top_k": 1,
                                              "max_tokens": 1}).json()["sources"]
        assert hits[0]["doc_id"] == "ferry-note" and "nine" in hits[0]["text"]
        # Asked for: replaced.
        replaced = client.post("/v1/documents", params={"replace": "true"}, json=other)
        assert replaced.status_code == 201 and replaced.json()["data"][0]["status"] == "updated"
        hits = client.post("/v1/query", json={"question": "When does the ferry to Sarne leave?", "top_k": 1,
                                              "max_tokens": 1}).json()["sources"]
        assert hits[0]["doc_id"] == "ferry-note" and "ten" in hits[0]["text"]
    finally:
        client.delete("/v1/documents/ferry-note")


def test_a_file_without_a_known_suffix_is_read_by_its_content_type(client):
    """The rule the OpenAPI description states: the format comes from the file name's suffix, else from the
    part's content type; neither known is a 422."""
    markdown = ("notes", b"# Tide tables\n\nHigh tide at six.", "text/markdown")
    upload = client.post("/v1/documents", files={"file": markdown})
    assert upload.status_code == 201, upload.text
    assert [(d["id"], d["title"]) for d in upload.json()["data"]] == [("notes", "Tide tables")]
    assert client.delete("/v1/documents/notes").status_code == 200
    assert_error(client.post("/v1/documents", files={"file": ("notes", b"%PDF", "application/pdf")}), 422, "file")


@contextmanager
def over_budget_client(engine_with, monkeypatch, **limits) -> Iterator[TestClient]:
    """A client of an app with the given limits whose engine fails the test if a request reaches the model."""
    from app.api.server import create_app

    def no_model_work(*args, **kwargs):
        raise AssertionError("a request over its budget reached the model")

    settings, engine = engine_with(limits=limits)
    monkeypatch.setattr(engine.parts.blender, "prefill_steps", no_model_work)  # (the planner computes nothing
    # before the prefill: every span the store lacks is computed in it)
    try:
        with TestClient(create_app(settings, engine)) as client:
            yield client
    finally:
        engine.parts.close()


def test_a_chat_over_its_token_budget_is_refused_before_any_model_work(engine_with, corpus, monkeypatch):
    limits = {"max_message_tokens": 300, "max_prompt_tokens": 600}
    long_turn = "The harbour wall was finished in 1956 and still stands today. " * 30  # ~400 tokens
    medium = "The harbour wall was finished in 1956. " * 15  # ~150 tokens
    with over_budget_client(engine_with, monkeypatch, **limits) as client:
        one_long = [{"role": "user", "content": "Tell me about the wall."},
                    {"role": "assistant", "content": long_turn}, {"role": "user", "content": "When?"}]
        error = assert_error(client.post("/v1/chat/completions", json={"messages": one_long}), 422, "messages.1")
        assert "limits.max_message_tokens" in error["message"] and "300" in error["message"]
        many = [{"role": r, "content": medium} for _ in range(3) for r in ("user", "assistant")]
        many.append({"role": "user", "content": "When was it finished?"})
        error = assert_error(client.post("/v1/chat/completions", json={"messages": many, "stream": True}), 422,
                             "messages")
        assert "limits.max_prompt_tokens" in error["message"] and "600" in error["message"]
        huge = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "x " * 1_000_000},
                {"role": "user", "content": "And?"}]  # refused without tokenizing 2 MB
        assert "limits.max_message_tokens" in assert_error(
            client.post("/v1/chat/completions", json={"messages": huge}), 422, "messages.1")["message"]


def test_passages_count_in_the_prompt_budget(engine_with, corpus, monkeypatch):
    """The passages are known only once retrieved: a prompt over the budget with them is a 400 before the
    prefill (a budget the question alone fits)."""
    with over_budget_client(engine_with, monkeypatch, max_prompt_tokens=120, max_top_k=4) as client:
        error = assert_error(client.post("/v1/query", json={"question": corpus.questions[0][0], "top_k": 4}), 400)
    assert "limits.max_prompt_tokens" in error["message"] and "top_k" in error["message"]


def test_corrupt_entries_are_counted_in_metrics_and_store_stats(corpus, engine_with):
    from app.api.server import create_app
    from app.engine.usage import store_report
    from store.serialize import parse_head

    settings, engine = engine_with(store={"memory_bytes": 0})  # disk only: a damaged file is read
    question = corpus.questions[0][0]
    with TestClient(create_app(settings, engine)) as client:
        assert client.post("/v1/query", json={"question": question, "top_k": 1, "max_tokens": 1}).status_code == 200
        [hit] = engine.parts.retriever.search(question, 1)
        key = engine.parts.kv_cache.key(engine.parts.kv_cache.passage_ids(hit.chunk.token_ids, hit.title))
        path = engine.parts.store.tiers[0]._cache.peek_file(key)
        data = bytearray(open(path, "rb").read())
        offset, length = parse_head(bytes(data)).layer_range(3)
        data[offset + length // 2] ^= 0x20
        open(path, "wb").write(bytes(data))

        answer = client.post("/v1/query", json={"question": question, "top_k": 1, "max_tokens": 1}).json()
        assert answer["stats"]["store_hits"] == {"computed": 1}  # recomputed, never used
        metrics = client.get("/metrics").text
    assert 'ragblend:kv_store_corrupt_total{tier="disk"} 1.0' in metrics, metrics
    assert 'ragblend:kv_store_stale_total{tier="disk"} 0.0' in metrics
    engine.parts.usage.flush()
    report = store_report(engine.parts.store.stats(), engine.parts.metadata.usage())
    assert report["dropped"]["corrupt"]["disk"] >= 1
    engine.parts.close()
