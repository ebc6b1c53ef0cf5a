"""Prompt caching on the request side: the store keys a prompt used (QueryResult.kv_keys), the `openai` client's
prompt_cache_key/prompt_cache_retention against a real server (cached_tokens, leases, the lease header), and a
lease the pinned cap refuses: the request still answers and says so."""
from __future__ import annotations

import httpx
import openai
import pytest

from app.engine.prompt_cache import LEASE_HEADER
from app.engine.query import QueryParams
from store import family_id
from tests.helpers import MODEL

pytestmark = pytest.mark.slow


def make_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_kv_keys_list_every_store_key_the_prompt_used(server_engine, corpus):
    """Head first, then the conversation (each exchange with its last turn's index), then the passages; the
    tokens of those read from the store are exactly the cached tokens; every key is in the store."""
    engine, store = server_engine, server_engine.parts.store
    messages = ({"role": "system", "content": "Be brief (kv_keys)."},
                {"role": "user", "content": "Who built the lighthouse of Port Velmar?"},
                {"role": "assistant", "content": "Ada Quenby built it."},
                {"role": "user", "content": "Thanks. And the bakery?"},
                {"role": "assistant", "content": "Tomas Brell founded it."},
                {"role": "user", "content": "When did Mount Orrin last erupt?"})
    params = QueryParams("When did Mount Orrin last erupt?", top_k=2, max_tokens=2, messages=messages)
    first = engine.answer(params)
    uses = first.kv_keys
    # head, each earlier message (its index), the passages' turn opening, two passages
    assert [u.message for u in uses] == [None, 1, 2, 3, 4, None, None, None]
    # the spans read: their tokens are the cached ones and those the blend recomputed
    assert sum(u.tokens for u in uses if u.cached) == first.stats.cached_tokens + first.stats.recomputed_tokens
    assert sum(u.tokens for u in uses) < first.stats.prompt_tokens  # the question is in no stored piece
    assert uses[0].cached is False and all(store.contains(u.key) for u in uses)  # a new system: its head computed
    again = engine.answer(params)
    assert [u.key for u in again.kv_keys] == [u.key for u in uses] and all(u.cached for u in again.kv_keys)
    assert again.stats.cached_tokens + again.stats.recomputed_tokens == sum(u.tokens for u in uses)

    alone = engine.answer(QueryParams("Who built the lighthouse of Port Velmar?", max_tokens=2, retrieve=False))
    assert [u.message for u in alone.kv_keys] == [None] and alone.sources == []  # the head alone
    assert engine.answer(QueryParams("Who won?", max_tokens=2, mode="full")).kv_keys == []  # no KV read or written


@pytest.fixture
def leases_ended(server_engine):
    """The session's store is shared: end the leases a test takes (other tests count the running ones)."""
    families: list[str] = []
    yield families
    for family in families:
        server_engine.parts.store.release(family)


def test_openai_prompt_cache_key_and_24h_retention_lease_the_conversation(make_app, corpus, serve_live, leases_ended):
    leases_ended.append("team-7: chess")
    with serve_live(make_app()) as live:
        client = make_client(live.url)
        messages = [{"role": "system", "content": "Answer from the passages. (openai 24h)"},
                    {"role": "user", "content": "Who won the Halden Open in 2019?"}]
        request = dict(model=MODEL, max_tokens=8, temperature=0, prompt_cache_key="team-7: chess",
                       prompt_cache_retention="24h", extra_body={"top_k": 1})
        raw = client.chat.completions.with_raw_response.create(messages=messages, **request)
        first = raw.parse()
        assert raw.headers[LEASE_HEADER] == "held"
        lease = first.model_extra["lease"]
        # the head, the passages' turn opening, the passage
        assert lease["status"] == "held" and lease["family"] == family_id("team-7: chess") and lease["entries"] == 3
        usage = first.usage  # the new system's head computed; the passage read: cached_tokens is the passage
        assert 0 < usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens

        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And which defence did she play?"}]
        chunks = list(client.chat.completions.create(messages=messages, stream=True,
                                                     stream_options={"include_usage": True}, **request))
        [finish] = [c for c in chunks if c.choices and c.choices[0].finish_reason]
        # ... and the spans of the two messages of the first exchange (one or more each: app.engine.planner)
        assert finish.model_extra["lease"]["status"] == "held" and finish.model_extra["lease"]["entries"] >= 5
        second = chunks[-1].usage  # the head and the first exchange come from the store now
        assert second.prompt_tokens_details.cached_tokens > usage.prompt_tokens_details.cached_tokens

        report = httpx.get(f"{live.url}/v1/cache", params={"prompt_cache_key": "team-7: chess"}).json()
        [family] = report["data"]
        assert family["entries"] >= 5 and family["soft"] and family["expires_at"] > first.created + 86000

        plain = client.chat.completions.with_raw_response.create(  # in_memory: plain LRU, nothing leased
            messages=messages, **request | {"prompt_cache_retention": "in_memory", "prompt_cache_key": "other"})
        assert LEASE_HEADER not in plain.headers and plain.parse().model_extra.get("lease") is None
        assert httpx.get(f"{live.url}/v1/cache", params={"prompt_cache_key": "other"}).json()["data"] == []
        bad = httpx.post(f"{live.url}/v1/chat/completions", json={
            "messages": messages, "prompt_cache_retention": "forever"})
        assert bad.status_code == 422 and bad.json()["error"]["param"] == "prompt_cache_retention"


def test_a_lease_over_the_pinned_cap_is_refused_and_the_response_says_so(server_engine, serve_live, tmp_path):
    """In a fresh data dir (its own lease ledger), memory pins at most one and a half system heads and disk nothing
    (cap 0). Two families' requests with one system share its head: leased in memory, refused on disk; a third
    with another system would pass memory's cap: refused there too. Every one answers, and says so."""
    import anthropic

    from app.api.server import create_app
    from app.components import Components
    from app.engine.rag_engine import RagEngine
    from tests.app.conftest import make_settings

    def engine(**store) -> RagEngine:
        settings = make_settings(tmp_path, store=store)
        parts = Components(settings)
        parts.llm, parts.embedder = server_engine.parts.llm, server_engine.parts.embedder
        return RagEngine(settings, parts)

    probe = engine()
    head = probe.answer(QueryParams("Hello?", max_tokens=1, retrieve=False, messages=(
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"}))).kv_keys[0]
    probe.parts.store.flush()  # the spans are written by the store's writer thread (put_nowait)
    head_bytes = probe.parts.store.tiers[0].size_of(head.key)
    probe.parts.close()
    capped = engine(memory_pinned_bytes=head_bytes * 3 // 2, disk_pinned_bytes=0)
    question = [{"role": "user", "content": "Who founded the Kestrel Bakery?"}]
    try:
        with serve_live(create_app(capped.settings, capped)) as live:
            client = anthropic.Anthropic(base_url=live.url, api_key="x", max_retries=0, timeout=300)

            def ask(user: str, system: str):
                return client.messages.with_raw_response.create(
                    model=MODEL, max_tokens=4, metadata={"user_id": user}, messages=question,
                    system=[{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}])

            for user in ("alice", "bob"):  # bob's head is alice's: a key pinned already adds no bytes
                raw = ask(user, "Be brief.")
                note = raw.parse().model_extra["lease"]
                assert raw.headers[LEASE_HEADER] == "refused" and raw.parse().content[0].text
                assert note["tiers"] == ["memory"] and "pinned cap is 0" in note["refused"]["disk"]
            raw = ask("carol", "Be very brief, please.")
            note = raw.parse().model_extra["lease"]
            assert raw.headers[LEASE_HEADER] == "refused" and raw.parse().content[0].text  # still answered
            assert note["tiers"] == [] and "pinned cap" in note["refused"]["memory"]
            report = httpx.get(f"{live.url}/v1/cache").json()
            memory = report["tiers"]["memory"]
            assert memory["pinned_bytes"] == head_bytes <= memory["pinned_cap"] and memory["lease_refusals"] == 1
            assert report["families"] == 2
    finally:
        capped.parts.close()
