"""The official `anthropic` client against a real uvicorn server: POST /v1/messages with system, tool_use and
tool_result blocks and cache_control breakpoints, streamed and not, over several turns; cache usage; leases;
the assistant's prefill continued (free text, under a tool's grammar, with retrieval); Anthropic's errors and
x-api-key."""
from __future__ import annotations

import anthropic
import httpx
import pytest

from app.engine.prompt_cache import LEASE_HEADER
from store import family_id
from tests.helpers import MODEL

pytestmark = pytest.mark.slow
EPHEMERAL = {"type": "ephemeral"}
SYSTEM = "You answer questions about lighthouses. Use the tool results you are given."
TOOLS = [{"name": "lookup", "description": "Look a fact up in the harbour records.",
          "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}}}]


@pytest.fixture(autouse=True)
def no_lease_left(server_engine):
    """The session's store is shared: end the leases these tests take (other tests count the running ones)."""
    yield
    for family in ("anthropic", "anthropic:tester"):
        server_engine.parts.store.release(family)


def make_client(url: str, api_key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=api_key, max_retries=0, timeout=300)


def first_turn(user: str, tag: str = "") -> list[dict]:
    """A user question, the assistant's tool call, and its result with a breakpoint: a prefix worth keeping
    (`tag`: one no other test has stored)."""
    return [{"role": "user", "content": [{"type": "text", "text": f"Who built the lighthouse of Port Velmar?{tag}"}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "lookup",
                                               "input": {"query": "Port Velmar lighthouse builder"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": "The lighthouse of Port Velmar was built in 1887 by the engineer Ada Quenby."},
                {"type": "text", "text": user, "cache_control": EPHEMERAL}]}]


def ask(client: anthropic.Anthropic, messages: list[dict], stream: bool, system: str = SYSTEM,
        **extra) -> anthropic.types.Message:
    # greedy (no temperature); the tools in the prompt, the answer text (12 tokens would cut a call: no answer)
    request = dict(model=MODEL, max_tokens=12, messages=messages, tools=TOOLS, tool_choice={"type": "none"},
                   system=[{"type": "text", "text": system, "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
                   metadata={"user_id": "tester"}, **extra)
    if not stream:
        return client.messages.create(**request)
    with client.messages.stream(**request) as events:
        kinds = [event.type for event in events]
        message = events.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(kinds)
    return message


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_multi_turn_exchange_creates_then_reads_its_cached_prefix(make_app, corpus, serve_live, stream):
    with serve_live(make_app()) as live:
        client = make_client(live.url)
        tag = f" ({'streamed' if stream else 'json'})"  # a prefix of its own: none of it stored yet
        messages, system = first_turn("So who was it?", tag), SYSTEM + tag

        first = ask(client, messages, stream, system)
        assert first.type == "message" and first.role == "assistant" and first.stop_reason in ("end_turn", "max_tokens")
        [block] = first.content
        assert block.type == "text" and block.text.strip()
        u = first.usage
        # The system and the first exchange (tool call included) are computed and stored under the breakpoints.
        assert u.cache_creation_input_tokens > 0 and u.input_tokens > 0 and u.output_tokens > 0
        if not stream:  # (the client's stream keeps message_start's breakdown, before any figure was known)
            c = u.cache_creation  # the system's breakpoint is 1h, the tool result's 5m
            assert c.ephemeral_1h_input_tokens > 0 and c.ephemeral_5m_input_tokens > 0
            assert c.ephemeral_1h_input_tokens + c.ephemeral_5m_input_tokens == u.cache_creation_input_tokens

        messages += [{"role": "assistant", "content": block.text},
                     {"role": "user", "content": [{"type": "text", "text": "When was it built?",
                                                   "cache_control": EPHEMERAL}]}]
        second = ask(client, messages, stream, system)
        v = second.usage
        # The prefix the first call created is read back: the system, the first exchange, and the exchange
        # the first call's answer closed (stored after it).
        assert v.cache_read_input_tokens >= u.cache_creation_input_tokens
        # The new question (under its breakpoint) is a message piece now: stored, so created, and little.
        assert v.cache_creation_input_tokens < v.cache_read_input_tokens
        assert v.input_tokens < v.cache_read_input_tokens

        lease = httpx.get(f"{live.url}/v1/cache", params={"prompt_cache_key": "anthropic:tester"}).json()
        assert lease["data"][0]["family"] == family_id("anthropic:tester") and lease["data"][0]["entries"] >= 3


def test_the_same_answer_streamed_and_not_with_the_lease_header(make_app, corpus, serve_live):
    with serve_live(make_app()) as live:
        client = make_client(live.url)
        messages = first_turn("Answer in one word: who?", tag=" (header)")
        raw = client.messages.with_raw_response.create(model=MODEL, max_tokens=10, messages=messages, tools=TOOLS)
        assert raw.headers[LEASE_HEADER] == "held"
        whole = raw.parse()
        with client.messages.stream(model=MODEL, max_tokens=10, messages=messages, tools=TOOLS) as events:
            streamed = events.get_final_message()
        assert streamed.content[0].text.strip() == whole.content[0].text.strip()  # greedy: the same tokens
        assert streamed.usage.output_tokens == whole.usage.output_tokens
        assert whole.model_extra["lease"]["status"] == "held"


BAD_CACHE_CONTROL = [
    ({"type": "persistent"}, "cache_control.type"),
    ({"type": "ephemeral", "ttl": "2h"}, "cache_control.ttl"),
]


@pytest.mark.parametrize("control, where", BAD_CACHE_CONTROL, ids=["unknown type", "ttl 2h"])
def test_bad_cache_control_gets_anthropics_400(live_server, control, where):
    client = make_client(live_server.url)
    with pytest.raises(anthropic.BadRequestError) as error:
        client.messages.create(model=MODEL, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": control}]}])
    assert error.value.status_code == 400
    assert error.value.body["type"] == "error" and error.value.body["error"]["type"] == "invalid_request_error"
    assert where in error.value.body["error"]["message"]


def test_more_than_four_breakpoints_each_lease_their_prefix(live_server):
    """Past Anthropic's 4: the leases are capped per tenant in bytes, so the count is not limited."""
    blocks = [{"type": "text", "text": f"part {i} (six breakpoints)", "cache_control": EPHEMERAL} for i in range(5)]
    raw = make_client(live_server.url).messages.with_raw_response.create(
        model=MODEL, max_tokens=2, cache_control=EPHEMERAL, messages=[{"role": "user", "content": blocks}])
    assert raw.headers[LEASE_HEADER] == "held" and raw.parse().usage.cache_creation_input_tokens > 0


def test_other_errors_are_anthropic_shaped(live_server):
    client = make_client(live_server.url)
    with pytest.raises(anthropic.BadRequestError) as error:  # a limit from settings: OpenAI's 422, Anthropic's 400
        client.messages.create(model=MODEL, max_tokens=100_000, messages=[{"role": "user", "content": "hi"}])
    assert error.value.body["error"]["type"] == "invalid_request_error" and "max_tokens" in \
        error.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):  # an image block: not supported
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])


def test_x_api_key_and_anthropic_version_are_accepted(make_app, corpus, serve_live):
    with serve_live(make_app(server={"api_key": "k-123"})) as live:
        message = make_client(live.url, "k-123").messages.create(  # sends x-api-key and anthropic-version
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Who founded the Kestrel Bakery?"}])
        assert message.content[0].type == "text"
        with pytest.raises(anthropic.AuthenticationError) as error:
            make_client(live.url, "wrong").messages.create(model=MODEL, max_tokens=2,
                                                           messages=[{"role": "user", "content": "hi"}])
        assert error.value.body["error"]["type"] == "authentication_error"
        bearer = httpx.get(f"{live.url}/v1/models", headers={"Authorization": "Bearer k-123"})
        assert bearer.status_code == 200  # Bearer still works everywhere
        assert httpx.get(f"{live.url}/v1/models", headers={"x-api-key": "k-123"}).status_code == 200
        assert "error" in httpx.get(f"{live.url}/v1/models").json()  # OpenAI-shaped off /v1/messages


PREFILL_ASKS = [{"role": "user", "content": "Who built the lighthouse of Port Velmar? Answer as JSON."},
                {"role": "assistant", "content": '{"builder": "'}]


def continued(client: anthropic.Anthropic, stream: bool, **request) -> anthropic.types.Message:
    if not stream:
        return client.messages.create(model=MODEL, **request)
    with client.messages.stream(model=MODEL, **request) as events:
        return events.get_final_message()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_prefill_is_continued_as_the_template_renders_it_open(live_server, server_engine, stream):
    """The assistant's last message is the answer's start: the prompt is the chat template's render left open (HF's
    continue_final_message), and the answer is its greedy continuation (as a full prefill of it gives it, here
    through the chat endpoint's continue_final_message and mode full), the continuation alone."""
    client = make_client(live_server.url)
    message = continued(client, stream, max_tokens=8, messages=PREFILL_ASKS)
    [block] = message.content
    assert message.stop_reason in ("end_turn", "max_tokens") and message.usage.output_tokens > 0
    system = {"role": "system", "content": server_engine.parts.prompt.system_prompt}
    ids = server_engine.parts.tokenizer.apply_chat_template([system, *PREFILL_ASKS], continue_final_message=True,
                                                            tokenize=True, return_dict=False)
    u = message.usage
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == len(ids)
    assert client.messages.count_tokens(model=MODEL, messages=PREFILL_ASKS).input_tokens == len(ids)
    full = httpx.post(f"{live_server.url}/v1/chat/completions", timeout=300, json={
        "model": MODEL + "-chat", "messages": PREFILL_ASKS, "max_tokens": 8, "continue_final_message": True,
        "mode": "full"}).json()
    assert full["usage"]["prompt_tokens"] == len(ids)
    assert block.type == "text" and block.text == full["choices"][0]["message"]["content"], (block.text, full)
    assert not block.text.startswith('{"builder"')  # the continuation alone, as Anthropic's


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_prefill_that_opens_a_call_ends_in_the_whole_call(live_server, stream):
    """Under tool_choice any, the prefill's tokens go to the grammar first: the model finishes the call it opened,
    and the call comes back whole as a tool_use block."""
    opened = '<tool_call>\n{"name": "lookup", "arguments": {"query": "'
    query = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 24}}, "required": ["query"],
             "additionalProperties": False}
    tools = [{**TOOLS[0], "input_schema": query}]
    message = continued(make_client(live_server.url), stream, max_tokens=40, tools=tools,
                        tool_choice={"type": "any", "disable_parallel_tool_use": True},
                        messages=[PREFILL_ASKS[0], {"role": "assistant", "content": opened}])
    assert message.stop_reason == "tool_use", message
    [call] = [b for b in message.content if b.type == "tool_use"]
    assert call.name == "lookup" and isinstance(call.input["query"], str), call
    assert not [b for b in message.content if b.type == "text" and b.text.strip()]


def test_a_prefill_the_grammar_refuses_is_a_400_naming_it(live_server):
    with pytest.raises(anthropic.BadRequestError) as error:
        make_client(live_server.url).messages.create(
            model=MODEL, max_tokens=4, tools=TOOLS, tool_choice={"type": "any"},
            messages=[PREFILL_ASKS[0], {"role": "assistant", "content": "Sure, here it is"}])
    assert error.value.body["error"]["type"] == "invalid_request_error"
    assert "messages: the assistant's prefill" in error.value.body["error"]["message"]


def test_a_prefill_after_retrieved_passages(live_server):
    """With retrieval the question is the last user message, asked over its passages, and the prefill follows."""
    client = make_client(live_server.url)
    messages = [{"role": "user", "content": "Who built the lighthouse of Port Velmar?"},
                {"role": "assistant", "content": "It was built by"}]
    message = client.messages.create(model=MODEL, max_tokens=6, extra_body={"retrieval": True}, messages=messages)
    [block] = message.content
    assert block.text.strip() and not block.text.lstrip().startswith("It was built by")
    u, alone = message.usage, client.messages.count_tokens(model=MODEL, messages=messages).input_tokens
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens > alone  # with its passages
