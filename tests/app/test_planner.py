"""The planner (app.engine.planner): a prompt's parts cut into spans and each span's KV source, decided once."""
from __future__ import annotations

import random
import time
from types import SimpleNamespace

import pytest
import torch

from app.config import PlannerSettings
from app.engine.planner import Part, Planner
from blend import ChunkKV, hash_ids
from tests.helpers import shared_tokenizer

HEAD = tuple(range(1000, 1020))


class FakeKV:
    """What the planner asks of app.engine.kv.ChunkKVCache: the head, the passages' context, reads by key."""

    def __init__(self):
        self.head_ids, self.entries = list(HEAD), {}
        self.blender = SimpleNamespace(fingerprint="model")
        self.store = SimpleNamespace(put=self.entries.__setitem__)
        self.head_key = "head"
        self.prompt = SimpleNamespace(tokenizer=shared_tokenizer())

    def context_hash(self) -> str:
        return hash_ids(list(HEAD))  # what a passage is computed after

    def passage_context(self, collection: str = "") -> str:
        return self.context_hash() + (f"@{collection}" if collection else "")

    def lookup_key(self, key, ids):
        kv = self.entries.get(key)
        return (kv, "memory") if kv is not None and kv.token_ids.tolist() == list(ids) else (None, None)

    open_key = lookup_key


def planner(**settings) -> Planner:
    return Planner(FakeKV(), PlannerSettings(**settings))


def text(seed: int, n: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(50_000) for _ in range(n))


def span_ids(p: Planner, parts) -> list[tuple[int, ...]]:
    return [s.ids for s in p.cut(parts)]


def message(ids, i=0) -> Part:
    return Part("message", tuple(ids), i)


def test_the_same_passage_gives_the_same_spans_behind_another_label_and_neighbours():
    p = planner()
    docs = [text(i, 110) for i in range(5)]  # ~100-token passages, as a RAG stack pastes them

    blank = shared_tokenizer().encode("\n\n")

    def stuffed(order, question):
        ids = list(text(99, 12)) + blank  # "Use the following documents..."
        for n, d in enumerate(order):  # "Document [n] (Title: ...):" differs with the place
            ids += list(text(200 + n, 6)) + list(d) + blank
        return [Part("head", HEAD), message(ids + list(text(question, 15)))]

    seen = set(span_ids(p, stuffed(docs, 1)))
    again = p.cut(stuffed(docs[::-1], 2))
    reused = sum(len(s.ids) for s in again if s.ids in seen)
    assert reused >= 0.8 * sum(map(len, docs))
    assert all(8 <= len(s.ids) <= 64 for s in again[1:])


def test_part_boundaries_are_hard_cuts_and_tiny_messages_merge():
    p = planner()
    a, b = text(1, 200), text(2, 200)
    spans = p.cut([Part("head", HEAD), message(a, 0), message(b, 1)])
    assert spans[0].ids == HEAD and spans[0].shared
    ends = {s.end for s in spans}
    assert len(HEAD) + len(a) in ends  # a message boundary is a cut
    assert [s.start for s in spans[1:]] == [s.end for s in spans[:-1]]  # back to back
    # 100 tiny messages cost about what 3 do: merged into spans of at least min_span_tokens
    tiny = [message(text(10 + i, 4), i) for i in range(100)]
    merged = p.cut([Part("head", HEAD), *tiny])
    assert len(merged) <= 1 + 400 // 8 + 1 and all(len(s.ids) >= 8 for s in merged[1:])
    assert merged[-1].message == 99
    # a retrieved passage is one span, never merged
    passage = Part("passage", text(3, 5))
    cut = p.cut([Part("head", HEAD), message(text(4, 3), 0), passage, Part("passage", text(5, 40))])
    assert [s.kind for s in cut] == ["head", "message", "passage", "passage"] and cut[2].ids == passage.ids


def test_hostile_prompts_are_linear_and_capped():
    p = planner(max_spans=64)
    paragraph = text(7, 40)
    for ids in (paragraph * 1000, text(8, 40_000), (13, 198) * 10_000):
        start = time.perf_counter()
        spans = p.cut([Part("head", HEAD), message(ids)])
        assert time.perf_counter() - start < 5  # linear: tens of milliseconds
        assert len(spans) <= 64 and sum(len(s.ids) for s in spans) == len(HEAD) + len(ids)
    many = p.cut([Part("head", HEAD), *(message((i,), i) for i in range(10_000))])
    assert len(many) <= 64


def test_the_windows_rule_finds_a_stored_window_at_any_offset():
    p = planner(chunking="windows", window_tokens=32)
    doc = text(9, 64)
    first = p.cut([Part("head", HEAD), message(doc)])
    assert [len(s.ids) for s in first[1:]] == [32, 32]
    for span in first[1:]:
        p._remember_window(span.ids)
    moved = p.cut([Part("head", HEAD), message(text(10, 5) + doc)])
    assert [s.ids for s in moved[1:]][1:3] == [s.ids for s in first[1:]]  # found 5 tokens later


def kv_of(ids, position, context) -> ChunkKV:
    n = len(ids)
    return ChunkKV(torch.zeros(1, 1, n, 2), torch.zeros(1, 1, n, 2), torch.tensor(ids), position, context, "model")


def store_plan(p: Planner, plan) -> None:
    """What Planner.store writes, without a prefill: each entry the spans lack, under its own context."""
    for span in plan.spans:
        if span.source != "exact":
            for context, key in p.entries(span, span.after, plan.tenant, plan.collection):
                p.kv.entries.setdefault(key, kv_of(span.ids, span.start, context))


def test_sources_exact_then_blended_then_computed_and_tenants_apart():
    p = planner()
    a, b = text(11, 60), text(12, 60)
    parts = [Part("head", HEAD), message(a, 0), message(b, 1)]
    first, _ = p.plan(parts, [1, 2], mode="blend")
    assert {s.source for s in first.spans[1:]} == {"compute"}
    store_plan(p, first)
    again, loaded = p.plan(parts, [1, 2], mode="blend")
    assert {s.source for s in again.spans[1:]} == {"exact"} and all(r.kv is not None for r in loaded[1:])
    swapped, _ = p.plan([Part("head", HEAD), message(b, 0), message(a, 1)], [1, 2], mode="blend")
    assert {s.source for s in swapped.spans[1:]} == {"blended"}
    prefix, _ = p.plan([Part("head", HEAD), message(b, 0), message(a, 1)], [1, 2], mode="prefix")
    assert {s.source for s in prefix.spans[1:]} == {"compute"}
    other, _ = p.plan(parts, [1, 2], mode="blend", tenant="someone else")
    assert {s.source for s in other.spans[1:]} == {"compute"}  # a client's text is its tenant's alone
    assert {s.key for s in other.spans[1:]}.isdisjoint(s.key for s in again.spans[1:])
    passage = Part("passage", text(13, 30))
    mine, _ = p.plan([Part("head", HEAD), passage], [1], mode="blend", tenant="a")
    store_plan(p, mine)
    theirs, _ = p.plan([Part("head", HEAD), passage], [1], mode="blend", tenant="b")
    assert mine.spans[1].key == theirs.spans[1].key  # the collection's passages are shared
    assert theirs.spans[1].source == "exact"  # right after the head, where it was computed
    # retrieval.documents: tenant: a tenant's passage is its collection's entry, found by that tenant alone
    acme, _ = p.plan([Part("head", HEAD), passage], [1], mode="blend", tenant="acme", collection="acme")
    assert acme.collection == "acme" and acme.spans[1].key not in (mine.spans[1].key, theirs.spans[1].key)
    store_plan(p, acme)
    found, _ = p.plan([Part("head", HEAD), passage], [1], mode="blend", tenant="acme", collection="acme")
    assert found.spans[1].source == "exact" and found.spans[1].key == acme.spans[1].key  # salted, yet exact
    later, _ = p.plan([Part("head", HEAD), Part("passage", text(14, 30)), passage], [1], mode="blend",
                      tenant="acme", collection="acme")
    assert later.spans[2].source == "blended"  # after another passage: its entry is shifted and blended
    elsewhere, _ = p.plan([Part("head", HEAD), passage], [1], mode="blend", tenant="beta", collection="beta")
    assert elsewhere.spans[1].source == "compute"


@pytest.mark.parametrize("mode", ["blend", "full"])
def test_the_computed_spans_at_the_end_run_with_the_question(mode):
    p = planner()
    plan, loaded = p.plan([Part("head", HEAD), message(text(14, 50))], [7, 8], mode=mode)
    assert plan.tail == (1 if mode == "blend" else 0) or plan.spans[0].source == "compute"
    assert plan.prompt_tokens == len(HEAD) + 50 + 2


def test_a_prompt_of_mostly_new_text_is_computed_whole_past_its_exact_prefix():
    p = planner(min_reused_share=0.3)  # (the default is measured; the rule is what is tested)
    seen, new = text(21, 40), text(22, 200)
    first, _ = p.plan([Part("head", HEAD), message(seen, 0)], [1], mode="blend")
    store_plan(p, first)
    mostly_new, loaded = p.plan([Part("head", HEAD), message(new, 0), message(seen, 1)], [1], mode="blend")
    assert {s.source for s in mostly_new.spans[1:]} == {"compute"}  # 40 of 240 tokens stored: not worth a blend
    assert all(r.kv is None for r in loaded[1:]) and mostly_new.tail == 1
    some_new, _ = p.plan([Part("head", HEAD), message(new[:60], 0), message(seen, 1)], [1], mode="blend")
    assert "blended" in {s.source for s in some_new.spans[1:]}  # 40 of 100: blended


def test_a_writer_with_no_room_left_gets_no_more_of_the_prompt():
    """Backpressure: Planner.store stops at the store's first refusal, so what is stored is the prompt's first spans
    (a clean prefix for its repeat), never scattered pieces of it."""
    p = planner()
    parts = [Part("head", HEAD), message(text(21, 120), 0)]
    plan, loaded = p.plan(parts, [1, 2], mode="blend")
    tokens = plan.spans[-1].end
    layer = SimpleNamespace(keys=torch.zeros(1, 1, tokens, 2), values=torch.zeros(1, 1, tokens, 2))  # [1, H, T, D]
    prefill = SimpleNamespace(cache=SimpleNamespace(layers=[layer, layer]))
    offered: list[str] = []

    def put_nowait(key, kv) -> bool:
        offered.append(key)
        return len(offered) <= 3  # room for three entries
    p.kv.store.put_nowait = put_nowait
    assert p.store(plan, loaded, prefill) == 3
    entries = list(dict.fromkeys(key for s in plan.spans if s.source == "compute" and s.kind != "head"
                                 for _, key in p.entries(s, s.after, plan.tenant, plan.collection)))
    assert len(entries) > 4 and offered == entries[:4]  # the first three taken, the fourth refused, then no more
