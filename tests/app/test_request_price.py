"""A request's prompt work is priced before any is done (its tokens, and each message as a piece at
limits.piece_cost_tokens more), and a message that says nothing is refused: both a 422 before the model sees the
request. The stub engine (its tokenizer counts words)."""
from __future__ import annotations

from fastapi.testclient import TestClient

from app.openai_models import ChatMessage

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
