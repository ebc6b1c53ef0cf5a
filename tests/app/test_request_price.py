"""A request's prompt work is priced before any is done (its tokens, and each message as a piece at
limits.piece_cost_tokens more), and a message that says nothing is refused: both a 422 before the model sees the
request. The stub engine (its tokenizer counts words)."""
from __future__ import annotations

from fastapi.testclient import TestClient

from app.api.schemas.openai import ChatMessage

WORDS = "one two three four five six seven eight".split()


def chat(client: TestClient, messages: list[dict]):
    return client.post("/v1/chat/completions", json={"model": "stub", "max_tokens": 1, "messages": messages})


def test_many_tiny_messages_are_priced_as_their_work(stub_app):
    app, engine = stub_app()
    with TestClient(app) as client:
        many = [{"role": "user" if i % 2 == 0 else "assistant", "content": " ".join(WORDS)} for i in range(511)]
        many.append({"role": "user", "content": "which one?"})
        refused = chat(client, many)  # 4,090 words, within max_prompt_tokens; priced at 8,186 with the pieces
        assert refused.status_code == 422, refused.text
        assert "limits.piece_cost_tokens" in refused.json()["error"]["message"] and engine.calls == 0
        words = " ".join(WORDS * 255)
        few = [{"role": "user", "content": words}, {"role": "assistant", "content": words},
               {"role": "user", "content": "which one?"}]
        accepted = chat(client, few)
        assert accepted.status_code == 200, accepted.text  # the same words in three messages
        assert "limits.piece_cost_tokens" in client.get("/openapi.json").text  # stated in the description


def test_a_message_that_says_nothing_is_refused(stub_app):
    app, engine = stub_app()
    with TestClient(app) as client:
        for empty in ({"role": "user", "content": ""}, {"role": "assistant", "content": None},
                      {"role": "tool", "tool_call_id": "c1", "content": "  "}, {"role": "user", "content": []}):
            response = chat(client, [empty, {"role": "user", "content": "hi"}])
            assert response.status_code == 422 and "says nothing" in response.text, (empty, response.text)
    assert engine.calls == 0
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    assert ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": calls}).tool_calls


def test_store_reads_and_passages_are_priced_before_any_kv_is_read(engine_with, corpus):
    """Once retrieval and the store lookup are done, the exact price (tokens computed, tokens read from the store at
    limits.read_token_cost, messages and passages as pieces) is checked: over the budget, a 400 naming it, before
    any KV is read or any layer runs (the real engine, the session's corpus: its passages are in the store)."""
    import re

    from app.api.server import create_app

    settings, engine = engine_with(limits={"piece_cost_tokens": 3000})
    question = corpus.questions[0][0]
    with TestClient(create_app(settings, engine)) as client:
        refused = client.post("/v1/query", json={"question": question, "top_k": 2, "max_tokens": 4})
        assert refused.status_code == 400, refused.text  # the question alone passed the route's price (1 piece)
        message = refused.json()["error"]["message"]
        read = re.search(r"(\d+) read from the store", message)
        assert read and int(read.group(1)) > 0 and "3 pieces" in message and "limits.read_token_cost" in message
        assert engine.parts.runtime.pool.free == engine.parts.runtime.pool.slots  # no prefill took a slot
        accepted = client.post("/v1/query", json={"question": question, "top_k": 1, "max_tokens": 4})
        assert accepted.status_code == 200, accepted.text  # 2 pieces: 6,000 + its tokens, within 7,680
        assert "limits.read_token_cost" in client.get("/openapi.json").text
