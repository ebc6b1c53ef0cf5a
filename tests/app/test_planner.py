"""The planner (app.engine.planner): a prompt's parts cut into spans and each span's KV source, decided once."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from app.config import PlannerSettings
from app.engine.loading import LoadingControl
from app.engine.planner import Part, Planner
from blend import ChunkKV, hash_ids
from blend.controller import Calibration, ChunkCost, Rates, Source, blend_or_whole
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
    return Planner(FakeKV(), PlannerSettings(**{"by_cost": True, **settings}))  # the cost rule is what is tested


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


def test_templated_records_pasted_again_in_another_order_are_found_again():
    """Text with little entropy (one JSON record template on one line, CSV rows): each document's spans are its
    own (a blank line always cuts) and found again behind other labels, in another order."""
    p, tokenizer, rng = planner(), shared_tokenizer(), random.Random(5)
    names, cities = ["Ada", "Bruno", "Chiara", "Dmitri", "Elif"], ["Oslo", "Quito", "Hanoi", "Perth"]

    def record() -> str:
        return (f'{{"id": {rng.randrange(10_000, 99_999)}, "name": "{rng.choice(names)}", "city": '
                f'"{rng.choice(cities)}", "quantity": {rng.randrange(1, 20)}, "status": "shipped"}}')

    docs = [", ".join(record() for _ in range(4)) for _ in range(3)]
    docs += ["\n".join(f"{rng.randrange(10_000)},{rng.choice(names)},{rng.choice(cities)},{rng.randrange(99)}"
                       for _ in range(8)) for _ in range(2)]

    def stuffed(order, label):
        blocks = [f"Document [{n}] (Source: {label} {i}):\n{docs[i]}" for n, i in enumerate(order, 1)]
        text = "Use the following documents to answer the question.\n\n" + "\n\n".join(blocks)
        return text, [Part("head", HEAD), message(tokenizer.encode(text + "\n\nQuestion: which city?"))]

    _, parts = stuffed(range(5), "tool result")
    seen = {s.ids for s in p.cut(parts)}
    _, parts = stuffed([3, 1, 4, 0, 2], "search hit")
    again = p.cut(parts)
    found = sum(len(s.ids) for s in again if s.ids in seen)
    assert found >= 0.9 * sum(len(tokenizer.encode(d)) for d in docs)
    pieces = [tokenizer.decode(s.ids) for s in again[1:]]
    assert all("\n\n" not in piece.rstrip("\n") for piece in pieces)  # no span runs across a blank line


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


def test_hostile_prompts_are_capped():
    p = planner(max_spans=64)
    paragraph = text(7, 40)
    for ids in (paragraph * 1000, text(8, 40_000), (13, 198) * 10_000):
        spans = p.cut([Part("head", HEAD), message(ids)])  # (no clock here: its cost is bench/'s to show)
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


def test_blend_or_whole_is_the_cheaper_prediction_from_the_rates():
    one = [ChunkCost(200, ())]                      # one large span found, its KV at hand
    scattered = [ChunkCost(10, ())] * 20           # the same tokens in twenty small spans
    free = Rates(1e-4)                             # 100 µs a token-layer, spans and loads free
    assert blend_or_whole(one, 100, free, layers=30, ratio=0.15).blend  # 85% of 200 tokens not computed
    assert blend_or_whole(scattered, 100, free, layers=30, ratio=0.15).blend
    costly = Rates(1e-4, span_s=1e-3)              # a span costs what 10 tokens do, a layer: they save 8.5
    assert blend_or_whole(one, 100, costly, layers=30, ratio=0.15).blend
    assert not blend_or_whole(scattered, 100, costly, layers=30, ratio=0.15).blend
    # a question pass over 24 of 30 layers: worth it for 200 cached tokens, not for 20 behind a long question
    assert blend_or_whole(one, 100, free, layers=30, ratio=0.15, question_tokens=100, question_layers=24).blend
    assert not blend_or_whole([ChunkCost(20, ())], 100, free, layers=30, ratio=0.15, question_tokens=100,
                              question_layers=24).blend
    # a slow tier: a layer of the span loads in 19 ms, just under its 20 ms recompute: hidden behind the layer's
    # 13 ms compute only in part when pipelined (still cheaper), not at all when not
    disk = [ChunkCost(200, (Source("disk", "int8", 50_000),))]
    slow, fast = Rates(1e-4, {"disk": 50_000 / 0.019}), Rates(1e-4, {"disk": 1e10})
    assert blend_or_whole(disk, 100, slow, layers=30, ratio=0.15, pipelined=True).blend
    assert not blend_or_whole(disk, 100, slow, layers=30, ratio=0.15, pipelined=False).blend
    assert blend_or_whole(disk, 100, fast, layers=30, ratio=0.15, pipelined=False).blend
    alone = blend_or_whole(disk, 100, Rates(1e-4, {"disk": 1e3}), layers=30, ratio=0.15)
    assert alone.blend_s == alone.whole_s and alone.blend  # recomputed from text anyway: left to plan_loading
    choice = blend_or_whole(one, 100, free, layers=30, ratio=0.15)
    assert choice.whole_s == pytest.approx(1e-4 * 30 * 300) and choice.blend_s == pytest.approx(1e-4 * 30 * 130)


def test_the_rates_come_from_prefills_whole_and_blended():
    cal = Calibration(alpha=1.0)
    cal.observe_prefill(1000 * 30, 3.0)            # computed whole: 100 µs a token-layer
    rates = cal.rates()
    assert rates.recompute_s == pytest.approx(1e-4) and rates.span_s == 0
    # blended: 300 tokens through the layers, 20 spans waited for 0.6 s
    cal.observe_prefill(300 * 30, 0.9, spans=(20 * 30, 0.6))
    rates = cal.rates()
    assert rates.span_s == pytest.approx(1e-3)
    # a question pass's rows priced as the layers' rows: 5 tokens through 24 layers at 100 µs
    assert blend_or_whole([ChunkCost(10, ())], 5, rates, layers=30, ratio=0.15, question_tokens=5,
                          question_layers=24).blend_s == pytest.approx(30 * (1e-4 * 6.5 + 1e-3) + 1e-4 * 5 * 24)


def test_plans_are_priced_once_enough_work_was_measured_each_prefill_weighed_by_its_work():
    control = LoadingControl(SimpleNamespace(num_layers=30, selection="random", check_layer=1), None, floor=0.15)
    control.calibration.observe_prefill(20 * 30, 0.06, spans=(4 * 30, 0.12))  # a tiny blend: 100 µs a token-layer
    assert control.planning_rates() is None  # 20 tokens, 4 spans: not enough to price a plan by (plans blend)
    control.calibration.observe_prefill(1000 * 30, 0.3, spans=(40 * 30, 0.12))  # 10 µs a token-layer
    rates = control.planning_rates()
    assert rates.recompute_s == pytest.approx(0.36 / (1020 * 30)) and rates.span_s == pytest.approx(0.24 / (44 * 30))
    control.calibration.observe_prefill(1000 * 30, 3.0, spans=(40 * 30, 1.2))
    assert control.planning_rates() is rates  # fixed once priced: a prompt's plan never turns on later timings


def costs(recompute_s: float, span_s: float) -> LoadingControl:
    """A loading controller whose measured rates are the ones given (spans found in memory: nothing to load)."""
    control = LoadingControl(SimpleNamespace(num_layers=30, selection="random", check_layer=1), None, floor=0.15)
    control.calibration.observe_prefill(1000 * 30, recompute_s * 1000 * 30, spans=(100 * 30, span_s * 100 * 30))
    return control


def test_the_planner_blends_only_where_it_is_predicted_faster():
    seen, new = text(21, 40), text(22, 200)
    p = planner()
    first, _ = p.plan([Part("head", HEAD), message(seen, 0)], [1], mode="blend")
    assert first.choice is None  # nothing found: nothing to decide
    store_plan(p, first)
    parts = [Part("head", HEAD), message(new, 0), message(seen, 1)]
    uncalibrated, _ = p.plan(parts, [1], mode="blend")
    assert "blended" in {s.source for s in uncalibrated.spans} and uncalibrated.choice is None  # no rates: blended
    p.costs = costs(1e-4, 0.0)
    cheap, _ = p.plan(parts, [1], mode="blend")
    assert "blended" in {s.source for s in cheap.spans} and cheap.choice["blend"]
    p.costs = costs(1e-4, 1e-2)  # a span costs what 100 tokens do
    dear, loaded = p.plan(parts, [1], mode="blend")
    assert {s.source for s in dear.spans[1:]} == {"compute"} and not dear.choice["blend"]
    assert all(r.kv is None for r in loaded[1:]) and dear.tail == 1  # all of it computed with the question
    again, _ = p.plan(parts, [1], mode="blend", ratio=1.0)  # recomputing every token saves nothing
    assert not again.choice["blend"] and p.plan(parts, [1], mode="reuse")[0].choice["blend_ms"] < dear.choice[
        "blend_ms"]


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


def stored_by(p: Planner, plan, loaded) -> None:
    """Planner.store after a prefill whose K/V at each position holds that position (the entries cut from it say
    where they were cut)."""
    tokens = plan.spans[-1].end
    keys = torch.arange(tokens, dtype=torch.float32).repeat_interleave(2).view(1, 1, tokens, 2)  # [1, H, T, D]
    layer = SimpleNamespace(keys=keys, values=-keys)
    p.kv.store.put_nowait = lambda key, kv: p.kv.entries.setdefault(key, kv) is not None
    p.store(plan, loaded, SimpleNamespace(cache=SimpleNamespace(layers=[layer, layer])))
    (context, key), = p.entries(plan.spans[0], "", plan.tenant)  # the head, which ChunkKVCache keeps
    p.kv.entries[key] = kv_of(HEAD, 0, context)


def test_a_document_behind_another_label_on_its_first_line_is_found_by_its_ending():
    """A label on a document's first line ("Document [2] (Title: …): {…") makes the span holding it differ; the
    tokens after the label are the stored span's last ones: that span is split, its ending blended from them."""
    tokenizer = shared_tokenizer()
    records = [", ".join(f'{{"id": {1000 + 7 * i + k}, "status": "shipped", "city": "Oslo"}}' for k in range(6))
               for i in range(3)]

    def stuffed(order, label):
        lines = [f"Document [{n}] (Title: {label} {i}): {records[i]}" for n, i in enumerate(order, 1)]
        return [Part("head", HEAD), message(tokenizer.encode("\n".join(lines) + "\n\n"))]

    p = planner(by_cost=False)
    first, loaded = p.plan(stuffed([0, 1, 2], "result"), [1], mode="blend")
    stored_by(p, first, loaded)
    before = {s.ids for s in p.cut(stuffed([0, 1, 2], "result"))}
    again, loaded = p.plan(stuffed([2, 0, 1], "search hit (copy 17)"), [1], mode="blend")
    plain = sum(len(s.ids) for s in p.cut(stuffed([2, 0, 1], "search hit (copy 17)")) if s.ids in before)
    blended = [(s, r) for s, r in zip(again.spans, loaded) if s.source == "blended"]
    assert sum(len(s.ids) for s, _ in blended) > plain + 3 * 8  # each document's first span found but its label
    for span, read in blended:  # each the KV of the same tokens where they were stored
        assert read.kv.token_ids.tolist() == list(span.ids)
        stored_at = read.kv.keys[0, 0, :, 0].long().tolist()
        assert stored_at == list(range(read.kv.position, read.kv.position + len(span.ids)))
        assert [t for s in first.spans for t in s.ids][read.kv.position:][:len(span.ids)] == list(span.ids)
    assert any(s.end != r.end for s in again.spans for r in p.cut(stuffed([2, 0, 1], "search hit (copy 17)"))
               if s.start == r.start)  # split where the label ends
    stored_by(p, again, loaded)
    repeat, _ = p.plan(stuffed([2, 0, 1], "search hit (copy 17)"), [1], mode="blend")
    assert [s.ids for s in repeat.spans] == [s.ids for s in again.spans]  # split alike: its own chain again
    assert {s.source for s in repeat.spans[1:]} == {"exact"}
    other, _ = p.plan(stuffed([2, 0, 1], "search hit (copy 17)"), [1], mode="blend", tenant="another")
    assert {s.source for s in other.spans[1:]} == {"compute"}  # another tenant's text is never found
