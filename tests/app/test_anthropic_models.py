"""/v1/messages without a model: a body as the engine's request, its breakpoints, the prefix each covers, and how
usage splits the prompt's tokens (read, created under a breakpoint, the rest)."""
from __future__ import annotations

import json

import pytest

from app.api.anthropic_routes import breakpoints, message_text, parse, system_text, usage
from app.api.errors import ApiError
from app.engine.prompt_cache import prefix_keys
from app.engine.query import KeyUse, QueryResult, QueryStats
from tests.helpers import MODEL

EPHEMERAL = {"type": "ephemeral"}
HOUR = {"type": "ephemeral", "ttl": "1h"}


def body(**fields) -> bytes:
    defaults = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    return json.dumps(defaults | fields).encode()


def test_a_body_becomes_the_system_turn_and_text_turns():
    request = parse(body(
        system=[{"type": "text", "text": "Be brief."}],
        tools=[{"name": "lookup", "description": "Find a fact.", "input_schema": {"type": "object"}}],
        messages=[{"role": "user", "content": "Who built it?"},
                  {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "lookup",
                                                     "input": {"q": "builder"}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                                                "content": [{"type": "text", "text": "not found"}]},
                                               {"type": "text", "text": "Try again?"}]}]))
    system = system_text(request)  # the tools in the Hermes form, then the system blocks
    assert system.startswith("You may call these tools:\n<tools>\n") and system.endswith("</tool_call>\n\nBe brief.")
    assert '"name": "lookup"' in system and "<tool_call>" in system
    assert [message_text(m) for m in request.messages] == [
        "Who built it?", '<tool_call>\n{"name": "lookup", "arguments": {"q": "builder"}}\n</tool_call>',
        "[tool result t1 (error): not found]\nTry again?"]


def test_breakpoints_anywhere_any_number():
    request = parse(body(
        system=[{"type": "text", "text": "S", "cache_control": HOUR}],
        tools=[{"name": "t", "cache_control": HOUR}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "a", "cache_control": EPHEMERAL}]},
                  {"role": "assistant", "content": "b"},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x", "content": [
                      {"type": "text", "text": "r", "cache_control": EPHEMERAL}]}]}]))
    assert sorted(breakpoints(request), key=str) == sorted([(None, 3600.0), (None, 3600.0), (0, 300.0), (2, 300.0)],
                                                           key=str)
    six = parse(body(cache_control=EPHEMERAL, messages=[{"role": "user", "content": [
        {"type": "text", "text": str(i), "cache_control": EPHEMERAL} for i in range(5)]}]))
    # past Anthropic's 4: leases are capped per tenant in bytes, not counted; the request's own is the last one
    assert breakpoints(six) == [(0, 300.0)] * 6


@pytest.mark.parametrize("fields, says", [
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {"type": "x"}}]}]},
     "messages.0.content.0.text.cache_control.type: Input should be 'ephemeral'"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {
        "type": "ephemeral", "ttl": "2h"}}]}]}, "cache_control.ttl: Input should be '5m' or '1h'"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": " "}]}]}, "messages.0.content"),
    ({"max_tokens": 0}, "max_tokens: Input should be greater than or equal to 1"),
])
def test_bad_bodies_are_400s_that_name_the_field(fields, says):
    with pytest.raises(ApiError) as error:
        parse(body(**fields))
    assert error.value.anthropic_status == 400 and says in error.value.message


def uses() -> list[KeyUse]:
    """Head (read), exchange through message 1 (read), exchange through 3 (computed), two passages (one read)."""
    return [KeyUse("head", 10, None, True), KeyUse("x1", 20, 1, True), KeyUse("x3", 30, 3, False),
            KeyUse("p1", 40, None, True), KeyUse("p2", 50, None, False)]


def test_a_breakpoint_covers_its_prefix():
    assert prefix_keys(uses(), None) == ["head"]
    assert prefix_keys(uses(), 2) == ["head", "x1"]
    assert prefix_keys(uses(), 3) == ["head", "x1", "x3"]  # passages follow the conversation: not a prefix


def test_usage_counts_each_prompt_token_once():
    # 70 tokens read (head, x1, p1), of which the blend recomputed 5: 65 read and not recomputed
    result = QueryResult("ok", [], QueryStats(mode="blend", prompt_tokens=170, completion_tokens=3, cached_tokens=65,
                                              recomputed_tokens=5), "stop", kv_keys=uses())
    marks = [(None, 3600.0), (3, 300.0)]  # x3 is computed under the 5m breakpoint
    u = usage(result, marks, last=4)
    assert (u.cache_read_input_tokens, u.cache_creation_input_tokens, u.input_tokens, u.output_tokens) == \
        (65, 30, 75, 3)
    assert (u.cache_creation.ephemeral_5m_input_tokens, u.cache_creation.ephemeral_1h_input_tokens) == (30, 0)
    whole = usage(result, [(4, 3600.0)], last=4)  # on the last message: the whole prompt, passages too
    assert (whole.cache_creation_input_tokens, whole.cache_creation.ephemeral_1h_input_tokens) == (80, 80)
    assert usage(result, [], last=4).cache_creation_input_tokens == 0  # no breakpoint: nothing asked to cache


def test_top_k_is_anthropics_sampling_parameter_not_the_passages():
    request = parse(body(top_k=500, retrieval=True))  # any sampling top_k: accepted (and ignored)
    assert request.top_k == 500 and request.retrieval_top_k is None  # the passages: retrieval.top_k
    assert parse(body(retrieval=True, retrieval_top_k=3)).retrieval_top_k == 3
