"""Multi-turn chat: the conversation in the prompt through the chat template, retrieval with a
follow-up made self-contained, the conversation's KV read back from the store at the next turn (the
`openai` client on a real uvicorn server), and the oldest turns dropped when the context is full."""
from __future__ import annotations

from types import SimpleNamespace
from urllib.parse import quote

import openai
import pytest

from app.engine.conversation import Conversation, is_follow_up
from app.engine.query import QueryParams, QueryStats
from blend import PromptFormat
from tests.helpers import MODEL, shared_tokenizer

# Two lighthouses in the demo corpus' style: which lamp "its" means depends on the first turn.
LIGHTHOUSES = {
    "cape-dorrin": ("Cape Dorrin Lighthouse",
                    "Cape Dorrin Lighthouse was built in 1902 by the engineer Walter Hesk on the island of Tollan. "
                    "Its lamp shines red and can be seen 18 kilometres out at sea. "
                    "The keeper's cottage is now a café."),
}


def message(role: str, content: str) -> SimpleNamespace:
    return SimpleNamespace(role=role, text=lambda: content)


# ---- the conversation, without a model --------------------------------------------------------

def test_messages_split_into_earlier_turns_and_question():
    chat = Conversation.from_messages([
        message("system", "Be brief."), message("user", "Who built it?"), message("assistant", " Ada. "),
        message("tool", "ignored"), message("developer", "Use British spelling."), message("user", "  "),
        message("user", "And when?"), message("assistant", "(a trailing prefill is ignored)")])
    assert chat.turns == (("user", "Who built it?"), ("assistant", " Ada. "))
    assert chat.question == "And when?"
    with pytest.raises(ValueError):
        Conversation.from_messages([message("assistant", "only me")])


@pytest.mark.parametrize("question, follow_up", [
    ("What colour is its lamp?", True), ("And when did it close?", True), ("Who was she?", True),
    ("How tall?", True), ("Why?", True), ("What about the bakery?", True),
    ("Who founded the Kestrel Bakery in Dunmore?", False),
    ("In which year did Mount Orrin last erupt?", False)])
def test_follow_up_rule(question, follow_up):
    assert is_follow_up(question) is follow_up


def test_retrieval_query_prepends_the_previous_exchange_only_for_follow_ups():
    turns = [message("user", "Who built Cape Dorrin Lighthouse?"), message("assistant", "Walter Hesk.")]
    follow = Conversation.from_messages([*turns, message("user", "What colour is its lamp?")])
    assert follow.retrieval_query() == "Who built Cape Dorrin Lighthouse? Walter Hesk. What colour is its lamp?"
    switch = Conversation.from_messages([*turns, message("user", "Who founded the Kestrel Bakery in Dunmore?")])
    assert switch.retrieval_query() == "Who founded the Kestrel Bakery in Dunmore?"
    assert Conversation.from_messages([message("user", "What is it?")]).retrieval_query() == "What is it?"


def test_a_chats_message_pieces_are_the_templates_own_rendering():
    prompt = PromptFormat(shared_tokenizer(), "Answer briefly.")
    chat = [{"role": "user", "content": "Who built it?"}, {"role": "assistant", "content": "Ada Quenby."},
            {"role": "user", "content": "When?"}, {"role": "assistant", "content": " 1887 "}]
    layout = prompt.chat.layout(chat)
    assert layout.split and len(layout.messages) == 4  # one per message
    whole = prompt.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Answer briefly."}] + [{**m, "content": m["content"].strip()} for m in chat],
        tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert layout.head + [i for span in layout.messages for i in span] + layout.tail == list(whole)
    # A message's piece does not depend on what came after it: the next turn finds it again.
    assert prompt.chat.layout(chat[:2]).messages == layout.messages[:2]
    # A client's system message joins the system turn (another head); the pieces after it are the same.
    other = prompt.chat.layout(chat, system="Be brief.")
    assert "Answer briefly.\n\nBe brief." in prompt.tokenizer.decode(other.head)
    assert other.messages == layout.messages and prompt.chat.layout(chat, system="  ").head == layout.head


# ---- on the real model ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lighthouses(live_server, corpus):
    client = openai.OpenAI(base_url=f"{live_server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    import httpx

    for doc_id, (title, text) in LIGHTHOUSES.items():
        response = httpx.post(f"{live_server.url}/v1/documents", json={"id": doc_id, "title": title, "text": text},
                              timeout=300)
        assert response.status_code == 201, response.text
    yield client
    for doc_id in LIGHTHOUSES:
        httpx.delete(f"{live_server.url}/v1/documents/{quote(doc_id, safe='')}", timeout=60)


@pytest.mark.slow
def test_two_turns_follow_up_uses_the_first_and_reads_it_from_the_cache(lighthouses):
    client = lighthouses
    ask = dict(model=MODEL, max_tokens=24, temperature=0, extra_body={"top_k": 1})
    turns = [{"role": "user", "content": "Who built Cape Dorrin Lighthouse?"}]
    first = client.chat.completions.create(messages=turns, **ask)
    assert "Hesk" in first.choices[0].message.content, first.choices[0].message.content
    assert first.model_extra["sources"][0]["doc_id"] == "cape-dorrin"

    # Alone, the follow-up finds another island (Mount Orrin's Sarne); after the first turn, Tollan.
    follow_up = "On which island is it?"
    alone = client.chat.completions.create(messages=[{"role": "user", "content": follow_up}], **ask)
    assert alone.model_extra["sources"][0]["doc_id"] != "cape-dorrin"
    turns += [{"role": "assistant", "content": first.choices[0].message.content},
              {"role": "user", "content": follow_up}]
    second = client.chat.completions.create(messages=turns, **ask)
    answer = second.choices[0].message.content
    assert "Tollan" in answer and "Sarne" not in answer, answer
    assert second.model_extra["sources"][0]["doc_id"] == "cape-dorrin"
    assert second.model_extra["dropped_messages"] == 0

    # The first exchange is new to this prompt as a message (the first turn had its question after the passages,
    # and its answer only in the decode): computed in the second turn's prefill and stored from it, nothing
    # computed after the answer. Streamed, the third turn reads it as an exact prefix.
    first_turn_tokens = len(shared_tokenizer()(
        "Who built Cape Dorrin Lighthouse?" + first.choices[0].message.content.strip())["input_ids"])
    turns += [{"role": "assistant", "content": answer}, {"role": "user", "content": "When was it built?"}]
    chunks = list(client.chat.completions.create(messages=turns, stream=True,
                                                 stream_options={"include_usage": True}, **ask))
    usage = chunks[-1].usage
    assert usage.prompt_tokens_details.exact_tokens > first_turn_tokens
    assert usage.prompt_tokens_details.cached_tokens - second.usage.prompt_tokens_details.cached_tokens > 0
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "1902" in text, text


@pytest.mark.slow
def test_oldest_turns_are_dropped_when_the_context_is_full(lighthouses, server_engine, monkeypatch):
    client = lighthouses
    filler = "The weather was grey and the sea was calm that day. " * 12  # ~150 tokens an exchange
    turns = []
    for i in range(4):
        turns += [{"role": "user", "content": f"Tell me story number {i}."},
                  {"role": "assistant", "content": f"Story {i}: {filler}"}]
    turns += [{"role": "system", "content": "Be brief."},
              {"role": "user", "content": "Who built Cape Dorrin Lighthouse?"}]
    ask = dict(model=MODEL, max_tokens=8, temperature=0, extra_body={"top_k": 1})
    everything = client.chat.completions.create(messages=turns, **ask)
    assert everything.model_extra["dropped_messages"] == 0
    # A context that holds everything but about two and a half exchanges: the two oldest go.
    limit = everything.usage.prompt_tokens + 8 - 400
    monkeypatch.setattr(server_engine, "_context_limit", lambda: limit)
    squeezed = client.chat.completions.create(messages=turns, **ask)
    assert squeezed.model_extra["dropped_messages"] == 6  # three exchanges of two messages each
    assert squeezed.usage.prompt_tokens + 8 <= limit
    # The layout the engine chose: the system message and the question stay, with the newest messages.
    params = QueryParams(turns[-1]["content"], top_k=1, messages=tuple(turns))
    plan, _ = server_engine.plan(params, 8, QueryStats(mode="blend"))
    prompt = server_engine.parts.prompt
    kinds = [s.kind for s in plan.spans]
    assert kinds[0] == "head" and kinds[-2:] == ["opening", "passage"] and set(kinds[1:-2]) == {"message"}
    assert list(plan.spans[0].ids) == prompt.chat.layout([], system="Be brief.").head
    assert list(plan.suffix) == prompt.suffix_ids(turns[-1]["content"], "Be brief.")
    messages = [s for s in plan.spans if s.kind == "message"]
    assert sorted({s.message for s in messages}) == [6, 7] and plan.dropped == 6
    assert "story number 3" in prompt.tokenizer.decode([t for s in messages if s.message == 6 for t in s.ids])


@pytest.mark.slow
def test_a_conversation_far_over_the_context_keeps_the_newest_messages_that_fit(server_engine, monkeypatch):
    """6,000 messages (a few MB): only the newest few hundred are even rendered, and a few renders decide what is
    kept. (The route refuses such a chat, over limits.max_messages; the engine alone keeps what fits.)"""
    monkeypatch.setattr(server_engine.settings.limits, "max_prompt_tokens", 1_000_000)
    turns = []
    for i in range(3000):
        turns += [{"role": "user", "content": f"Question {i} about the harbour wall and its granite blocks?"},
                  {"role": "assistant", "content": f"Answer {i}: " + "the wall was finished in 1956. " * 20}]
    turns.append({"role": "user", "content": "When was the harbour wall finished?"})
    template, rendered = server_engine.parts.prompt.chat, []
    original = template.layout

    def counting(messages, *args, **kwargs):
        rendered.append(len(messages))
        return original(messages, *args, **kwargs)

    params = QueryParams(turns[-1]["content"], top_k=1, messages=tuple(turns))
    monkeypatch.setattr(template, "layout", counting)
    plan, _ = server_engine.plan(params, 16, QueryStats(mode="blend"))
    kept = plan.prompt_tokens + 16
    limit = server_engine._context_limit()
    messages = [s for s in plan.spans if s.kind == "message"]
    assert 0 < plan.dropped < len(turns) and sorted({s.message for s in messages}) == list(range(plan.dropped, 6000))
    assert kept <= limit and limit - kept < 300  # one more message (~150 tokens) would not have fit
    assert len(rendered) <= 4 and max(rendered) < 2000
