"""Agents (issue #39): every message a cached piece, tool calls and results through the chat template,
retrieval optional, the cache lookup, bad messages refused; on the real model (the session's engine) and
through the official `openai` client against a real server."""
from __future__ import annotations

import copy
import json
import time
import uuid

import openai
import pytest

from app.engine.query import QueryParams, QueryStats
from blend import PromptFormat
from tests.helpers import MODEL, shared_tokenizer

TOOLS = ({"type": "function", "function": {"name": "search", "description": "Search the documents.",
                                           "parameters": {"type": "object",
                                                          "properties": {"q": {"type": "string"}}}}},)
RESULTS = ["The lighthouse of Port Velmar was built in 1887 by the engineer Ada Quenby.",
           "Its lamp shines green and can be seen 30 kilometres out at sea.",
           "The keeper's cottage is now a small museum."]


def task(nonce: str) -> dict:
    """The task message; `nonce` keeps one test's entries from another's (keys are content hashes)."""
    return {"role": "user", "content": f"[{nonce}] Who built the lighthouse whose lamp shines green?"}


def call(i: int, query: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": "search", "arguments": json.dumps({"q": query})}}]}


def result(i: int) -> dict:
    return {"role": "tool", "tool_call_id": f"call_{i}", "content": RESULTS[i]}


def trace(nonce: str, order: list[int]) -> tuple[dict, ...]:
    """The task, then a (call, result) pair per tool result in `order`."""
    return (task(nonce), *[m for i in order for m in (call(i, f"query {i}"), result(i))])


def tail_tokens(engine) -> int:
    """The assistant turn's opening: the one part of a prompt without retrieval that is never cached."""
    return len(engine.parts.prompt.chat.layout([]).tail)


def ask(engine, messages: tuple[dict, ...], **options):
    params = QueryParams("", messages=messages, tools=TOOLS, retrieve=False, max_tokens=6, **options)
    return engine.answer(params)


# ---- the chat template: tool calls and tool results, on the rendered ids ----------------------------

# A template that renders tools and tool calls itself (Qwen2.5's shape, cut down).
NATIVE_TEMPLATE = (
    "{{- '<|im_start|>system\\n' + messages[0].content }}"
    "{%- if tools %}{{- '\\n# Tools' }}{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- for m in messages[1:] %}"
    "{%- if m.role == 'assistant' and m.tool_calls is defined %}{{- '<|im_start|>assistant\\n' + m.content }}"
    "{%- for c in m.tool_calls %}{{- '<tool_call>' + c.function.name + ' ' + c.function.arguments + '</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response id=' + m.tool_call_id + '>' + m.content"
    " + '</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def rendered_ids(tokenizer, messages: list[dict], tools=None) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=True,
                                              return_dict=True)["input_ids"])


def joined(layout) -> list[int]:
    return layout.head + [i for span in layout.messages for i in span] + layout.tail


def test_tool_calls_and_results_through_a_template_that_renders_them():
    tokenizer = copy.deepcopy(shared_tokenizer())
    tokenizer.chat_template = NATIVE_TEMPLATE
    prompt = PromptFormat(tokenizer, "Answer briefly.")
    assert prompt.chat.native_tool_calls and prompt.chat.native_tools
    messages = list(trace("native", [0, 1]))
    layout = prompt.chat.layout(messages, TOOLS)
    assert layout.split and len(layout.messages) == len(messages)
    system = {"role": "system", "content": "Answer briefly."}
    assert joined(layout) == rendered_ids(tokenizer, [system, *[{**m, "content": m["content"] or ""}
                                                                for m in messages]], list(TOOLS))
    call_text, result_text = (tokenizer.decode(layout.messages[i]) for i in (1, 2))
    assert call_text == '<|im_start|>assistant\n<tool_call>search {"q": "query 0"}</tool_call><|im_end|>\n'
    assert result_text == f"<|im_start|>user\n<tool_response id=call_0>{RESULTS[0]}</tool_response><|im_end|>\n"
    assert '"name": "search"' in tokenizer.decode(layout.head)


def test_tool_calls_and_results_through_a_template_that_does_not():
    """SmolLM2's template knows no tools: the calls become text in the Hermes form, the tools join the system
    turn, and the pieces are still exactly what the template renders of that."""
    prompt = PromptFormat(shared_tokenizer(), "Answer briefly.")
    template = prompt.chat
    assert not template.native_tool_calls and not template.native_tools
    messages = list(trace("text", [0, 1]))
    layout = template.layout(messages, TOOLS)
    assert layout.split and len(layout.messages) == len(messages)
    expected = [template.system_message(None, TOOLS), *[template.normalized(m) for m in messages]]
    assert joined(layout) == rendered_ids(prompt.tokenizer, expected)
    decode = prompt.tokenizer.decode
    assert decode(layout.messages[1]) == ('<|im_start|>assistant\n<tool_call>\n{"name": "search", "arguments": '
                                          '{"q": "query 0"}}\n</tool_call><|im_end|>\n')  # (Hermes: an object)
    assert decode(layout.messages[2]) == f"<|im_start|>tool\n{RESULTS[0]}<|im_end|>\n"
    assert "<tools>" in decode(layout.head) and '"name": "search"' in decode(layout.head)
    # A message's span does not depend on its neighbours: the same ids wherever it stands.
    moved = template.layout(list(trace("text", [1, 0])), TOOLS)
    assert moved.messages[3:5] == layout.messages[1:3]


# ---- message spans on the real model ----------------------------------------------------------------

def kv_of(result, messages: range) -> set[str]:
    """How the spans of these messages had their KV (app.engine.planner: exact, blended, compute)."""
    return {s["kv"] for s in result.stats.spans if s["message"] in messages}


@pytest.mark.slow
def test_the_same_messages_after_the_same_prefix_are_an_exact_prefix(server_engine):
    nonce = uuid.uuid4().hex
    first = ask(server_engine, trace(nonce, [0]))
    assert kv_of(first, range(3)) == {"compute"} and first.stats.exact_tokens <= first.stats.cached_tokens
    grown = ask(server_engine, trace(nonce, [0, 1]))
    # (a span of the new messages may be known by content: the tool call's opening, say)
    assert kv_of(grown, range(3)) == {"exact"} and "compute" in kv_of(grown, range(3, 5)) <= {"compute", "blended"}
    again = ask(server_engine, trace(nonce, [0]))
    assert kv_of(again, range(3)) == {"exact"} and again.stats.recomputed_tokens == 0
    # The whole prompt but the assistant's opening came from the store, exact; the answer is the same.
    tail = tail_tokens(server_engine)
    assert again.stats.exact_tokens == again.stats.cached_tokens == again.stats.prompt_tokens - tail
    assert again.answer == first.answer
    uses = [u for u in again.kv_keys if u.message is not None]
    assert sorted({u.message for u in uses}) == [0, 1, 2] and all(u.cached for u in uses)


@pytest.mark.slow
def test_a_message_seen_before_at_a_new_position_is_read_from_the_store_and_blended(server_engine):
    nonce = uuid.uuid4().hex
    ask(server_engine, trace(nonce, [0]))
    ask(server_engine, trace(nonce, [0, 1]))  # every message's spans now stored (by chain and by content)
    moved = ask(server_engine, trace(nonce, [1, 0]), ratio=0.15)  # the two tool exchanges swapped
    stats = moved.stats
    # none computed (the moved call's opening, the same tokens after the same ones, is even exact)
    assert kv_of(moved, range(1)) == {"exact"} and "blended" in kv_of(moved, range(1, 5)) <= {"exact", "blended"}
    layout = server_engine.parts.prompt.chat.layout(list(trace(nonce, [1, 0])), TOOLS)
    moved_tokens = sum(map(len, layout.messages[1:]))
    # cached_tokens: read and not recomputed; recomputed_tokens beside it
    assert stats.cached_tokens + stats.recomputed_tokens == stats.prompt_tokens - tail_tokens(server_engine)
    blended_tokens = stats.prompt_tokens - tail_tokens(server_engine) - stats.exact_tokens
    assert 0 < blended_tokens <= moved_tokens
    assert 0 < stats.recomputed_tokens <= round(0.15 * blended_tokens) + 1
    blended = [u for u in moved.kv_keys if u.message in (1, 2, 3, 4)]
    # read by content, then stored as this prompt had them: kv_keys names those entries, the ones the same
    # prompt reads next (an exact prefix)
    assert all(u.cached for u in blended) and all(server_engine.parts.store.contains(u.key) for u in blended)
    again = ask(server_engine, trace(nonce, [1, 0]), ratio=0.15)
    assert kv_of(again, range(5)) == {"exact"} and again.answer == moved.answer
    assert [u.key for u in again.kv_keys] == [u.key for u in moved.kv_keys]
    # Prefix caching (mode prefix) reads the exact prefix only: every moved message is computed again.
    other = uuid.uuid4().hex
    ask(server_engine, trace(other, [0, 1]), mode="prefix")
    prefix = ask(server_engine, trace(other, [1, 0]), mode="prefix")
    assert kv_of(prefix, range(1)) == {"exact"} and "compute" in kv_of(prefix, range(1, 5))
    assert "blended" not in kv_of(prefix, range(5)) and prefix.stats.recomputed_tokens == 0
    head_and_task = server_engine.parts.prompt.chat.layout(list(trace(other, [])), TOOLS)
    assert prefix.stats.cached_tokens == prefix.stats.exact_tokens >= len(head_and_task.head) + len(
        head_and_task.messages[0])


@pytest.mark.slow
def test_retrieval_off_gives_a_prompt_without_passages(server_engine, corpus):
    question = corpus.questions[0][0]
    messages = ({"role": "user", "content": question},)
    off, _ = server_engine.plan(QueryParams(question, messages=messages, retrieve=False, top_k=2), 8,
                                 QueryStats(mode="blend"))
    on, _ = server_engine.plan(QueryParams(question, messages=messages, top_k=2), 8, QueryStats(mode="blend"))
    assert [s.kind for s in off.spans] == ["head", "message"] and off.hits == ()
    assert [s.kind for s in on.spans] == ["head", "opening", "passage", "passage"] and len(on.hits) == 2
    assert list(off.suffix) == server_engine.parts.prompt.chat.layout(list(messages)).tail  # the assistant's opening
    result = server_engine.answer(QueryParams(question, messages=messages, retrieve=False, max_tokens=4))
    assert result.sources == [] and result.stats.store_hits == {}


@pytest.mark.slow
def test_the_context_keeps_the_newest_messages_that_fit(server_engine, monkeypatch):
    nonce = uuid.uuid4().hex
    messages = trace(nonce, [0, 1, 2])
    everything, _ = server_engine.plan(QueryParams("", messages=messages, retrieve=False), 8, QueryStats(mode="blend"))
    total = everything.prompt_tokens
    monkeypatch.setattr(server_engine, "_context_limit", lambda: total + 8 - 20)  # the task message goes
    squeezed, _ = server_engine.plan(QueryParams("", messages=messages, retrieve=False), 8, QueryStats(mode="blend"))
    assert squeezed.dropped >= 1 and sorted({s.message for s in squeezed.spans[1:]}) == list(range(squeezed.dropped, 7))
    assert squeezed.prompt_tokens + 8 <= total + 8 - 20


# ---- through the HTTP API ------------------------------------------------------------------------

def wait_for_exact(client, body: dict, messages: int) -> dict:
    """POST /v1/cache/lookup until the first `messages` messages are exact (the answer before stores them
    after it is sent) and return the report."""
    deadline = time.monotonic() + 120
    while True:
        report = client.post("/v1/cache/lookup", json=body).json()
        exact = {p["message"] for p in report["pieces"] if p["kind"] == "message" and p["cached"] == "exact"}
        if len(exact) >= messages or time.monotonic() > deadline:
            return report
        time.sleep(0.2)


@pytest.mark.slow
def test_lookup_reports_what_the_next_request_reuses(client):
    nonce = uuid.uuid4().hex
    body = {"model": MODEL, "messages": list(trace(nonce, [0, 1])), "tools": list(TOOLS), "retrieval": False,
            "max_tokens": 4}
    cold = client.post("/v1/cache/lookup", json=body).json()
    kinds = [p["kind"] for p in cold["pieces"]]  # app.engine.planner's spans: each message one or more
    assert kinds[0] == "head" and set(kinds[1:]) == {"message"} and {p["message"] for p in cold["pieces"][1:]} == {
        0, 1, 2, 3, 4}
    # The task is new; the tool exchanges may be known from other tests (keys are content), never exact here.
    assert cold["pieces"][1]["cached"] is None and all(p["cached"] != "exact" for p in cold["pieces"][1:])
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    warm = wait_for_exact(client, body, 5)
    assert warm["exact_tokens"] == warm["cached_tokens"] < warm["prompt_tokens"] < warm["cached_tokens"] + 8
    assert {p["tier"] for p in warm["pieces"]} <= {"memory", "disk", "gpu", "redis"}
    usage = client.post("/v1/chat/completions", json=body).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == warm["cached_tokens"]
    assert usage["prompt_tokens_details"]["exact_tokens"] == warm["exact_tokens"]

    swapped = {**body, "messages": list(trace(nonce, [1, 0]))}
    report = client.post("/v1/cache/lookup", json=swapped).json()
    assert {p["cached"] for p in report["pieces"] if p["message"] in (None, 0)} == {"exact"}
    assert "blendable" in {p["cached"] for p in report["pieces"] if p["message"] not in (None, 0)} <= {
        "blendable", "exact"}  # (the moved call's opening: the same tokens after the same ones, exact)
    usage = client.post("/v1/chat/completions", json=swapped).json()["usage"]
    details = usage["prompt_tokens_details"]  # cached: read and not recomputed; recomputed beside it
    assert details["cached_tokens"] + details["recomputed_tokens"] == report["cached_tokens"]
    assert usage["prompt_tokens_details"]["exact_tokens"] == report["exact_tokens"]
    assert usage["prompt_tokens_details"]["recomputed_tokens"] > 0

    text = client.post("/v1/cache/lookup", json={"prompt": "Who built the lighthouse?", "top_k": 1}).json()
    assert [p["kind"] for p in text["pieces"]] == ["head", "passage"] and text["cached_tokens"] > 0


@pytest.mark.parametrize("message, reason", [
    ({"role": "robot", "content": "hi"}, "role"),
    ({"role": "tool", "content": "42"}, "tool_call_id"),
    ({"role": "tool", "tool_call_id": "c", "content": "x" * 2_000_000}, "max_message_tokens"),
])
def test_bad_messages_get_a_4xx_with_the_reason(client, message, reason):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "What now?"}, message], "max_tokens": 4}
    response = client.post("/v1/chat/completions", json=body)
    assert 400 <= response.status_code < 500, response.text
    assert reason in response.json()["error"]["message"], response.text
    assert client.post("/v1/cache/lookup", json=body).status_code == response.status_code


def test_too_many_messages_get_a_422(make_app, corpus):
    from fastapi.testclient import TestClient

    with TestClient(make_app(limits={"max_messages": 3})) as small:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}] * 4, "max_tokens": 4}
        response = small.post("/v1/chat/completions", json=body)
    assert response.status_code == 422 and "at most 3 messages" in response.json()["error"]["message"]


@pytest.mark.slow
def test_the_openai_client_runs_an_agent_conversation_with_tools(live_server):
    client = openai.OpenAI(base_url=f"{live_server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    rag, plain, _embedder = [m.id for m in client.models.list()]
    assert plain == rag + "-chat"
    nonce = uuid.uuid4().hex
    messages: list = [{"role": "system", "content": "You are a research agent."}, task(nonce)]
    # the tools in the prompt, the answers text (8 tokens would cut a call, and a cut call is no answer)
    options = dict(max_tokens=8, temperature=0, tools=list(TOOLS), tool_choice="none")
    for turn in range(2):
        messages += [call(turn, f"query {turn}"), result(turn)]
        for model, extra, retrieved in ((plain, {}, False), (rag, {"retrieval": False}, False),
                                        (rag, {"top_k": 1}, True)):
            completion = client.chat.completions.create(model=model, messages=messages, extra_body=extra, **options)
            answer = completion.choices[0].message.content
            assert completion.model == (rag if retrieved else plain)
            assert len(completion.model_extra["sources"]) == (1 if retrieved else 0)
            chunks = list(client.chat.completions.create(model=model, messages=messages, extra_body=extra,
                                                         stream=True, stream_options={"include_usage": True},
                                                         **options))
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip() == answer
            assert chunks[-1].usage.prompt_tokens == completion.usage.prompt_tokens
            assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the head at least, stored by now
        messages.append({"role": "assistant", "content": answer})
        messages.append({"role": "user", "content": "And what next?"})
    assert completion.usage.prompt_tokens > 100
