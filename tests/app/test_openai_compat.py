"""The official `openai` client against a real uvicorn server: models, chat completions streamed
and not, usage, errors and the API key."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.helpers import MODEL

pytestmark = pytest.mark.slow


def make_client(url: str, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=300)


def test_chat_completion_streamed_and_not(live_server, corpus):
    client = make_client(live_server.url)
    model, _, _embedder = [m.id for m in client.models.list()]
    question, doc_id, words = corpus.questions[0]
    request = dict(model=model, messages=[{"role": "user", "content": question}], max_tokens=14, temperature=0,
                   seed=7, extra_body={"top_k": 1, "mode": "blend"})

    completion = client.chat.completions.create(**request)
    answer = completion.choices[0].message.content
    assert any(w in answer for w in words), answer
    assert completion.choices[0].finish_reason in ("stop", "length") and completion.model == model
    usage = completion.usage
    assert usage.prompt_tokens + usage.completion_tokens == usage.total_tokens
    assert 0 < usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens
    assert completion.model_extra["sources"][0]["doc_id"] == doc_id  # ragblend's extra field

    chunks = list(client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip() == answer  # greedy: the same tokens, streamed
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [completion.choices[0].finish_reason]
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    # With include_usage the last chunk has no choices and the usage: the same counts as the non-streamed
    # answer's, and at least as much of the prompt cached (the first request stored the question's message).
    streamed = chunks[-1].usage
    assert chunks[-1].choices == [] and (streamed.prompt_tokens, streamed.completion_tokens) == \
        (usage.prompt_tokens, usage.completion_tokens)
    assert usage.prompt_tokens_details.cached_tokens <= streamed.prompt_tokens_details.cached_tokens <= \
        streamed.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_errors_arrive_as_openai_errors(live_server):
    client = make_client(live_server.url)
    with pytest.raises(openai.UnprocessableEntityError) as error:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2)
    assert error.value.body["param"] == "n" and error.value.code == "invalid_value"
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True,
                                       max_tokens=100_000)


def test_api_key(make_app, corpus, serve_live):
    with serve_live(make_app(server={"api_key": "k-123"})) as live:
        assert [m.id for m in make_client(live.url, "k-123").models.list()] == [
            "smollm2-135m-instruct", "smollm2-135m-instruct-chat", "all-MiniLM-L6-v2"]
        with pytest.raises(openai.AuthenticationError):
            make_client(live.url, "wrong").models.list()


def test_an_assistant_message_last_is_a_turn_or_with_continue_final_message_a_prefill(live_server):
    """As OpenAI's API, an assistant's message last is a finished turn, answered by a new one; vLLM's extra
    continue_final_message makes it a prefill, continued as Anthropic's /v1/messages continues one (the same
    tokens, streamed or not)."""
    client = make_client(live_server.url)
    messages = [{"role": "user", "content": "Who built the lighthouse of Port Velmar? Answer as JSON."},
                {"role": "assistant", "content": '{"builder": "'}]
    request = dict(model=MODEL + "-chat", messages=messages, max_tokens=8, temperature=0)
    continued = client.chat.completions.create(**request, extra_body={"continue_final_message": True})
    answered = client.chat.completions.create(**request)
    assert continued.choices[0].message.content != answered.choices[0].message.content
    assert continued.usage.prompt_tokens < answered.usage.prompt_tokens  # no end of turn, no new turn's opening
    anthropic_body = {"model": MODEL, "max_tokens": 8, "messages": messages}
    message = httpx.post(f"{live_server.url}/v1/messages", json=anthropic_body, timeout=300).json()
    assert continued.choices[0].message.content == message["content"][0]["text"]
    chunks = client.chat.completions.create(**request, stream=True, extra_body={"continue_final_message": True})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).rstrip() == \
        continued.choices[0].message.content
