"""What a new user reads as bugs, on the real engine: Anthropic's `thinking`, image and document blocks and a
nameless tool_choice are 400s that name them; count_tokens refuses what /v1/messages refuses; a long question on
the RAG model id names the `-chat` id that takes it; /v1/embeddings cuts a long text only when asked (vLLM's
`truncate_prompt_tokens`, which its 400 names), is priced per request and per tenant, and never holds up an upload
(it runs on its own lane)."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from tests.helpers import MODEL

pytestmark = pytest.mark.slow
EMBEDDER = "all-MiniLM-L6-v2"
HI = [{"role": "user", "content": "hi"}]


def anthropic_error(response: httpx.Response) -> str:
    assert response.status_code == 400, response.text
    assert response.json()["type"] == "error"
    return response.json()["error"]["message"]


@pytest.mark.parametrize("block", ["image", "document"])
def test_an_anthropic_block_it_cannot_read_is_named(client, block):
    content = [{"type": "text", "text": "What is this?"},
               {"type": block, "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]
    message = anthropic_error(client.post("/v1/messages", json={"model": MODEL, "max_tokens": 1,
                                                                "messages": [{"role": "user", "content": content}]}))
    assert message.startswith(f"messages.0.content.1: {block} blocks are not supported"), message
    assert "tag" not in message and "discriminator" not in message


def test_anthropic_thinking_is_refused_by_name_and_disabled_is_taken(client):
    body = {"model": MODEL, "max_tokens": 1, "messages": HI}
    message = anthropic_error(client.post("/v1/messages", json={**body, "thinking": {"type": "enabled",
                                                                                      "budget_tokens": 1024}}))
    assert message.startswith("thinking: extended thinking is not supported"), message
    assert client.post("/v1/messages", json={**body, "thinking": {"type": "disabled"}}).status_code == 200


def test_anthropic_tool_choice_tool_needs_its_name(client):
    tools = [{"name": "lookup", "input_schema": {"type": "object"}}]
    message = anthropic_error(client.post("/v1/messages", json={"model": MODEL, "max_tokens": 1, "messages": HI,
                                                                "tools": tools,
                                                                "tool_choice": {"type": "tool", "name": None}}))
    assert "tool_choice" in message and "name" in message


@pytest.mark.parametrize("field", [{"top_k": 0}, {"temperature": 3}, {"top_p": 0}])
def test_count_tokens_refuses_what_messages_refuses(client, field):
    body = {"model": MODEL, "messages": HI, **field}
    counted = anthropic_error(client.post("/v1/messages/count_tokens", json=body))
    answered = anthropic_error(client.post("/v1/messages", json={**body, "max_tokens": 1}))
    assert counted == answered.replace("; max_tokens: Field required", "") and next(iter(field)) in counted
    fine = client.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": HI, "top_k": 5})
    assert fine.status_code == 200


def test_a_long_question_on_the_rag_model_names_the_chat_model(client):
    pasted = "The harbour log records ships arriving and leaving every day of the season. " * 40  # ~3,000 chars
    body = {"model": MODEL, "messages": [{"role": "user", "content": pasted}], "max_tokens": 1}
    refused = client.post("/v1/chat/completions", json=body)
    assert refused.status_code == 422 and refused.json()["error"]["param"] == "messages"
    assert f"'{MODEL}-chat'" in refused.json()["error"]["message"], refused.json()
    assert client.post("/v1/chat/completions", json={**body, "model": f"{MODEL}-chat"}).status_code == 200


def vectors(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return np.array([d["embedding"] for d in response.json()["data"]])


def test_embeddings_cut_a_long_text_only_when_asked(client):
    words = [f"{w}" for w in "the cat sat on a mat and then the dog ran to the park".split()]
    long_text = " ".join(words * 40)  # ~560 word pieces, over the 254 the embedder reads
    refused = client.post("/v1/embeddings", json={"model": EMBEDDER, "input": long_text})
    assert refused.status_code == 400 and "truncate_prompt_tokens" in refused.json()["error"]["message"]
    cut = vectors(client.post("/v1/embeddings", json={"model": EMBEDDER, "input": [long_text, "a short one"],
                                                      "truncate_prompt_tokens": 6}))
    head = vectors(client.post("/v1/embeddings", json={"model": EMBEDDER, "input": [" ".join(words[:6]),
                                                                                      "a short one"]}))
    np.testing.assert_allclose(cut, head, atol=1e-5)  # the first 6 pieces, the short text untouched
    whole = vectors(client.post("/v1/embeddings", json={"model": EMBEDDER, "input": long_text,
                                                        "truncate_prompt_tokens": -1}))
    assert whole.shape == (1, 384) and not np.allclose(whole, cut[:1], atol=1e-3)


def test_embeddings_are_priced_per_request_and_per_tenant(make_app):
    texts = ["a few words to embed here"] * 8  # 7 word pieces each, 8 more as a piece: 120
    with TestClient(make_app(limits={"max_embedding_tokens": 100})) as client:
        refused = client.post("/v1/embeddings", json={"model": EMBEDDER, "input": texts})
        assert refused.status_code == 422 and refused.json()["error"]["param"] == "input"
        assert "56 word pieces in 8 texts, priced at 120" in refused.json()["error"]["message"]
        assert "limits.max_embedding_tokens" in refused.json()["error"]["message"]
    with TestClient(make_app(limits={"max_tenant_embedding_tokens": 100})) as client:
        refused = client.post("/v1/embeddings", json={"model": EMBEDDER, "input": texts})
        assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
        assert "limits.max_tenant_embedding_tokens" in refused.json()["error"]["message"]
        assert vectors(client.post("/v1/embeddings", json={"model": EMBEDDER, "input": texts[:4]})).shape == (4, 384)


def test_an_upload_is_not_held_up_by_embeddings_calls(make_app, serve_live):
    """Four large embeddings calls at once, then an upload: the upload is in (201) before the last embeddings call
    has answered (they run on their own lane, a slice at a time; the upload on the ingest lane)."""
    text = "Ships come into the harbour at dawn and leave again with the evening tide, laden with fish. " * 8
    finished: list[str] = []
    lock = threading.Lock()

    def call(kind: str, http: httpx.Client) -> int:
        if kind == "upload":
            status = http.post("/v1/documents", json={"id": "not-starved", "text": "The ferry to Sarne sails at "
                                                                                  "noon on Fridays."}).status_code
        else:
            status = http.post("/v1/embeddings", json={"model": EMBEDDER, "input": [text] * 96}).status_code
        with lock:
            finished.append(kind)
        return status

    app = make_app()
    with serve_live(app) as live, httpx.Client(base_url=live.url, timeout=600) as http, \
            ThreadPoolExecutor(5) as pool:
        embeds = [pool.submit(call, "embed", http) for _ in range(4)]
        svc = app.state.service
        while svc.lane.snapshot()["current"] is None:  # the ingest lane is busy with embeddings
            threading.Event().wait(0.02)
        upload = pool.submit(call, "upload", http)
        assert upload.result() == 201
        assert [e.result() for e in embeds] == [200] * 4
        assert http.delete("/v1/documents/not-starved").status_code == 200
    assert finished.index("upload") < len(finished) - 1, finished
