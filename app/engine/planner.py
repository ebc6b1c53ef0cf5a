"""The planner: a prompt's token ids → spans, each saying where its KV comes from. The one place a request's
KV sources are decided, looked up and stored.

The request gives its boundaries as Parts (head, each message, the passages' turn opening, each retrieved
passage; the question/suffix is apart and always computed). `cut` divides them into spans: a head or a
retrieved passage is one span; any other part (a message, a document pasted into one, a tool result) is cut
by its content (blend.chunking: the same text gives the same spans wherever it appears, behind any label), or
in mode `windows` into fixed windows matched at any offset (LMCache's rule, for comparison). Part boundaries
are hard cuts; spans under `min_span_tokens` merge with the next (so 100 tiny messages cost as 3), and a
prompt with more than `max_spans` spans is cut coarser until it has no more.

Each span's KV, decided once (`plan`), in prompt order:
    exact    a stored entry computed after exactly the tokens before it: used as is. Found by the chain key
             (the hash of everything before it) while every span before it is exact, or by the content key
             when the entry there was computed at this very place.
    blended  an entry found by its content key (its own tokens, after the head): RoPE-shifted and blended. A span
             found by neither key whose ending a stored span shares (a document behind another label: the span
             holding the label differs before the text) is split there: the tokens shared are that entry's last
             ones, blended; the rest is looked up again (the planner remembers the endings of the spans it stored).
    compute  no entry: computed in the prefill itself (blend.Blender.fresh between cached spans; at the end
             with the question), then stored from that prefill's own KV (`store`: no extra compute).
Keys mix in the model fingerprint and, for every span but the shared head and the collection's passages, the
tenant: a client's prompt text is found only by its own tenant. A passage's key mixes in its collection when that
is a tenant's (retrieval.documents: tenant; app.engine.kv.ChunkKVCache.passage_context), as ingest stored it.
"""
from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Literal

import numpy as np
import torch

from app.config import PlannerSettings
from app.engine.kv import ChunkKVCache
from app.engine.loading import LoadingControl
from app.engine.query import KeyUse, QueryStats
from app.engine.usage import COMPUTED
from blend import ChunkKV, Prefill, hash_ids
from blend.chunking import content_cuts
from blend.pipeline import LayerSource
from store import kv_key

PartKind = Literal["head", "message", "opening", "passage"]
Source = Literal["exact", "blended", "compute"]
WINDOW_INDEX_MAX = 1 << 16  # window hashes remembered (mode windows): the oldest forgotten first
ENDINGS_MAX = 1 << 14  # stored spans' endings remembered (mode content; ~300k tokens of text, at most 17 MB): the
ENDING_SPANS = 4       # oldest forgotten first; under each, the latest spans (templated text repeats its endings)
WHOLE = "whole"  # a found span's Loaded tier once the plan computed the prompt whole (_blend_or_whole): its entry kept


@dataclass(frozen=True)
class Part:
    """A boundary the request gives: a hard cut."""
    kind: PartKind
    ids: tuple[int, ...]
    message: int | None = None  # a message: its index in QueryParams.messages


@dataclass(frozen=True)
class Span:
    kind: PartKind          # the part it starts in
    ids: tuple[int, ...]
    start: int              # its first position in the prompt
    message: int | None     # the last message it covers (None: head, opening, passage)
    shared: bool            # the standard head or a collection passage: keyed without the tenant
    source: Source = "compute"
    key: str = ""           # its entry by chain (a passage, a head: its one key): what the same prompt reads next
    tier: str | None = None
    after: str = ""         # hash_ids of the ids before it: what its KV is computed after here

    @property
    def end(self) -> int:
        return self.start + len(self.ids)


@dataclass(frozen=True)
class Plan:
    hits: tuple = ()
    spans: tuple[Span, ...] = ()
    suffix: tuple[int, ...] = ()  # the question and the assistant turn's opening: always computed
    dropped: int = 0              # a chat's oldest messages left out (they did not fit the context)
    tenant: str = ""              # mixed into the keys of the client's text
    collection: str = ""          # the documents' collection its passages come from ("" shared)
    choice: dict | None = None    # found spans: blended or computed whole, as predicted (blend.controller.Choice)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(s.ids) for s in self.spans) + len(self.suffix)

    @property
    def tail(self) -> int:
        """The index of the first span computed with the question: the computed spans at the end, or, behind a
        blended span, only the last of them (the others are fresh segments of the blend: a selection's question
        pass runs what is computed with the question through most layers, and the main pass again, so a long
        computed tail would be paid almost twice; in a scattered prompt it was most of the prompt)."""
        end = len(self.spans)
        while end > 0 and self.spans[end - 1].source == "compute":
            end -= 1
        if any(s.source == "blended" for s in self.spans[:end]):
            end = max(end, len(self.spans) - 1)
        return end if self.suffix else min(end, len(self.spans) - 1)  # no suffix: the last span runs there


@dataclass
class Loaded:
    """A span's KV as read (the loading controller may swap it for a slower tier's, or for a fresh span)."""
    ids: list[int]
    kv: ChunkKV | LayerSource | None
    tier: str | None
    start: int = 0  # its position in the prompt

    def close(self) -> None:
        """Release a store entry opened for layer-wise reads (an in-memory ChunkKV holds nothing to release)."""
        if self.kv is not None and hasattr(self.kv, "close") and not isinstance(self.kv, ChunkKV):
            self.kv.close()


class Planner:
    def __init__(self, kv_cache: ChunkKVCache, settings: PlannerSettings, pipeline: bool = False,
                 costs: LoadingControl | None = None, ratio: float = 0.15):
        self.kv, self.settings, self.pipeline = kv_cache, settings, pipeline
        self.costs, self.ratio = costs, ratio  # the measured rates a blend is priced by; the ratio when none is asked
        self.fingerprint = kv_cache.blender.fingerprint
        self._windows: dict[int, None] = {}  # mode windows: hashes of the windows stored (insertion order)
        # mode content: a stored span's last min_span_tokens ids -> the latest spans stored ending so, ids as int32
        # bytes (compact, hashable); plans read it off the model thread while `store` writes it on it
        self._endings: dict[bytes, tuple[bytes, ...]] = {}
        self._endings_lock = threading.Lock()

    @cached_property
    def breaks(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids of tokens holding a line break, of those holding a blank line): cut candidates, the blank line (where
        pasted documents meet) always a cut, so each document's spans are its own."""
        tokenizer = getattr(self.kv.prompt, "tokenizer", None) if hasattr(self.kv, "prompt") else None
        if tokenizer is None:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        newlines = {i: t.replace("Ċ", "\n").count("\n") or int(t == "<0x0A>")  # byte-level BPE, SentencePiece
                    for i, t in enumerate(vocab) if t}
        return (np.array(sorted(i for i, k in newlines.items() if k), dtype=np.int64),
                np.array(sorted(i for i, k in newlines.items() if k > 1), dtype=np.int64))

    # ---- cutting ---------------------------------------------------------------------------------

    def cut(self, parts: Sequence[Part]) -> list[Span]:
        """The prompt's spans (no source yet), at most `max_spans` (cut coarser until so)."""
        s = self.settings
        average, low, high = s.average_span_tokens, s.min_span_tokens, max(s.max_span_tokens, 2 * s.min_span_tokens)
        while True:
            spans = self._cut(parts, average, low, high)
            passages = sum(p.kind == "passage" for p in parts)
            if len(spans) <= s.max_spans or low * 2 > sum(len(p.ids) for p in parts) or len(spans) <= passages + 1:
                return spans
            average, low, high = average * 2, low * 2, high * 2

    def _cut(self, parts: Sequence[Part], average: int, low: int, high: int) -> list[Span]:
        head = self.kv.head_ids
        raw: list[tuple[Part, int, int]] = []  # (part, start in the part, end)
        for part in parts:
            if part.kind in ("head", "passage") or not part.ids:
                ends = [len(part.ids)] if part.ids else []
            elif self.settings.chunking == "windows":
                ends = self._window_cuts(part.ids)
            else:
                lines, blank = self.breaks
                ends = content_cuts(part.ids, average=average, min_tokens=low, max_tokens=high, breaks=lines,
                                    paragraphs=blank)
            raw += [(part, a, b) for a, b in zip([0] + ends, ends)]
        spans: list[Span] = []
        position, pending, size = 0, [], 0
        if self.settings.chunking == "windows":
            low = 1  # LMCache's windows: what lies between found windows stays apart
        for i, (part, a, b) in enumerate(raw):
            pending.append((part, a, b))
            size += b - a
            mergeable = part.kind in ("message", "opening") and b == len(part.ids)  # (a blank line's cut stays)
            following = raw[i + 1][0] if i + 1 < len(raw) else None
            if mergeable and size < low and following is not None and following.kind in ("message", "opening"):
                continue  # a tiny message joins the next (a hard cut may merge, never split)
            ids = tuple(t for p, x, y in pending for t in p.ids[x:y])
            first = pending[0][0]
            shared = first.kind == "passage" or (first.kind == "head" and list(ids) == head)
            messages = [p.message for p, _, _ in pending if p.message is not None]
            spans.append(Span(first.kind, ids, position, messages[-1] if messages else None, shared))
            position, pending, size = position + len(ids), [], 0
        return spans

    def _window_cuts(self, ids: Sequence[int]) -> list[int]:
        """Mode windows: a stored window found at any offset is a span; the rest in fixed windows from where the
        last match ended (a rolling hash, linear in the length)."""
        w, n = self.settings.window_tokens, len(ids)
        aligned = lambda a, b: [min(e, b) for e in range(a + w, b + w, w)] if b > a else []  # noqa: E731
        hashes, ends, start, i = list(_rolling(ids, w)), [], 0, 0
        while i < len(hashes):
            if hashes[i] in self._windows:
                ends += aligned(start, i) + [i + w]
                start = i = i + w
            else:
                i += 1
        return ends + aligned(start, n)

    # ---- the plan --------------------------------------------------------------------------------

    def plan(self, parts: Sequence[Part], suffix: Sequence[int], *, mode: str, tenant: str = "", read: bool = True,
             collection: str = "", ratio: float | None = None, **rest) -> tuple[Plan, list[Loaded]]:
        """The plan and, with `read`, each span's KV as read (without it, where each entry is, nothing read).
        Mode full: no lookups (every span computed); prefix: everything after the exact chain computed; blend: the
        spans found blended, or all computed with the question where that is predicted faster (`ratio`: the one
        asked, else the default)."""
        spans, loaded, chain, exact = [], [], hashlib.sha256(), mode != "full"
        source: Source
        pending = self.cut(parts)[::-1]  # a stack: a span split at a stored span's ending is looked up in two
        while pending:
            span = pending.pop()
            before = chain.hexdigest()  # sha256 of the ids before: hash_ids(before), computed incrementally
            keys = [key for _, key in self.entries(span, before, tenant, collection)]
            found, source = Loaded(list(span.ids), None, None, span.start), "compute"
            if mode != "full" and (exact or mode != "prefix"):
                for k, candidate in enumerate(keys):
                    if k == 0 and len(keys) == 2 and not exact:
                        continue  # a chain key: only while every span before is exact
                    found = self._find(candidate, span, read)
                    if found.tier is not None and k == 1 and span.kind == "message":
                        self._remember_ending(span.ids)  # (stored by another process: found by its ending too)
                    if found.tier is not None:  # exact by its chain key, or a passage computed right here
                        here = (k == 0 and len(keys) == 2) or span.kind == "head" or (
                            found.kv.position == span.start and self._computed_after(found, span) == before)
                        source = "exact" if exact and here else "blended"
                        break
            if source == "blended" and mode == "prefix":  # prefix caching: what is not exact is computed
                found.close()
                found, source = Loaded(list(span.ids), None, None, span.start), "compute"
            if source == "compute" and mode not in ("full", "prefix") and (ending := self._ending(span)):
                stored, shared = ending
                if shared < len(span.ids):  # the rest first, then the tokens shared, each looked up on its own
                    pending += [replace(span, ids=span.ids[-shared:], start=span.end - shared),
                                replace(span, ids=span.ids[:-shared])]
                    continue
                found = self._find_ending(stored, span, tenant, read)
                source = "compute" if found.tier is None else "blended"
            chain.update(np.asarray(span.ids, dtype="<i8").tobytes())
            exact = exact and source == "exact"
            # its entry (kv_keys, leases): the chain's, the one the same prompt reads next (a blended or computed
            # span is stored there: `store`); a passage's or a head's only key
            spans.append(Span(span.kind, span.ids, span.start, span.message, span.shared, source, keys[0],
                              found.tier, before))
            loaded.append(found)
        ratio = 0.0 if mode == "reuse" else self.ratio if ratio is None else ratio
        choice = self._blend_or_whole(spans, loaded, len(suffix), ratio)
        return Plan(spans=tuple(spans), suffix=tuple(suffix), tenant=tenant, collection=collection, choice=choice,
                    **rest), loaded

    def _blend_or_whole(self, spans: list[Span], loaded: list[Loaded], suffix: int, ratio: float) -> dict | None:
        """Past the exact prefix, the found spans blended or, where computing it all with the question is predicted
        faster from the measured rates (app.engine.loading: blend.controller.blend_or_whole), all computed (prefix
        caching). Small scattered spans cost more to blend (each its own read, shift and run of keys, the selection)
        than they save. Not measured yet (no prefill run), or planner.by_cost off: blended. Returns the prediction (the
        plan's `choice`)."""
        start = next((i for i, s in enumerate(spans) if s.source != "exact"), len(spans))
        found = [i for i in range(start, len(spans)) if spans[i].source == "blended"]
        if not found or self.costs is None or not self.settings.by_cost:
            return None
        computed = sum(len(s.ids) for s in spans[start:] if s.source == "compute") + suffix
        tail = len(spans[-1].ids) if found[-1] < len(spans) - 1 else 0  # computed with the question (Plan.tail)
        choice = self.costs.blend_or_whole([loaded[i] for i in found], computed, ratio=ratio,
                                           question_tokens=tail + suffix, pipelined=self.pipeline)
        if choice is None or choice.blend:
            return None if choice is None else choice.as_dict()
        for i in found:
            loaded[i].close()
            spans[i] = replace(spans[i], source="compute", tier=None)
            loaded[i] = Loaded(list(spans[i].ids), None, WHOLE, spans[i].start)  # found, computed: `store`
        return choice.as_dict()

    def entries(self, span: Span, before: str, tenant: str, collection: str = "") -> list[tuple[str, str]]:
        """(context, key) of each entry a span may be stored under, as the store names it (kv_key of the model,
        the context, the ids): a client's text under its chain (what precedes it: exact) and its content (found
        anywhere: blended), each with the tenant mixed in; a head under its chain alone; a collection passage
        under its content alone (and its collection), as ingest stored it (after the prompt head)."""
        if span.shared and span.kind == "passage":
            contexts = [self.kv.passage_context(collection)]
        elif span.kind == "head":
            contexts = [hash_ids([]) if span.shared else _salted(hash_ids([]), tenant)]
        else:
            contexts = [_salted(before, tenant), self._content_context(tenant)]
        return [(context, kv_key(self.fingerprint, context, list(span.ids))) for context in contexts]

    def _content_context(self, tenant: str) -> str:
        """A client's text found anywhere ("content" keeps it from ever equalling a chain's context)."""
        return _salted(self.kv.context_hash(), "content\x00" + tenant)

    # ---- spans found by their ending -------------------------------------------------------------

    def _ending(self, span: Span) -> tuple[tuple[int, ...], int] | None:
        """(a stored span, how many of its last ids `span` ends with) for the stored span sharing the most, at least
        min_span_tokens; None if none does. Cuts are decided by content, so a document's spans end alike wherever
        it appears; what precedes it on its first line (a label) is what differs."""
        low = self.settings.min_span_tokens
        if span.kind != "message" or self.settings.chunking != "content" or len(span.ids) < low:
            return None
        ids = np.asarray(span.ids, dtype=np.int32)
        best, shared = None, 0
        for stored in self._endings.get(ids[-low:].tobytes(), ()):
            n = _shared_ending(np.frombuffer(stored, dtype=np.int32), ids)
            if n > shared:
                best, shared = stored, n
        return None if best is None else (tuple(np.frombuffer(best, dtype=np.int32).tolist()), shared)

    def _find_ending(self, stored: tuple[int, ...], span: Span, tenant: str, read: bool) -> Loaded:
        """`span`'s KV as the last len(span) tokens of the stored span's content entry (read whole: one span's)."""
        key, skip = kv_key(self.fingerprint, self._content_context(tenant), list(stored)), len(stored) - len(span.ids)
        if not read:
            found = self._find(key, replace(span, ids=stored), read=False)
            meta = None if found.kv is None else _Meta(found.kv.position + skip, found.kv.context_hash)
            return Loaded(list(span.ids), meta, found.tier, span.start)  # type: ignore[arg-type]
        kv, tier = self.kv.lookup_key(key, stored)
        return Loaded(list(span.ids), None if kv is None else ending_kv(kv, len(span.ids)), tier, span.start)

    def _remember_ending(self, span_ids: tuple[int, ...]) -> None:
        low = self.settings.min_span_tokens
        if self.settings.chunking != "content" or len(span_ids) < low:
            return
        ids = np.asarray(span_ids, dtype=np.int32)
        stored, ending = ids.tobytes(), ids[-low:].tobytes()
        with self._endings_lock:
            kept = self._endings.pop(ending, ())
            self._endings[ending] = (stored, *(s for s in kept if s != stored))[:ENDING_SPANS]
            if len(self._endings) > ENDINGS_MAX:
                del self._endings[next(iter(self._endings))]

    def stored(self, plan: Plan) -> tuple[tuple[int, int], ...]:
        """The positions [start, end) of the spans `store` will keep after this plan's prefill (its prefill attends
        to their store round trip: blend.cache.StoredSpans)."""
        return tuple((span.start, span.end) for span in plan.spans if _kept(span, span.source))

    def _computed_after(self, found: Loaded, span: Span) -> str:
        """The hash of what `found`'s entry was computed after: a collection passage's context is salted with its
        collection (so tenants' entries stay apart), yet it was computed after the head, as every passage is."""
        return self.kv.context_hash() if span.shared and span.kind == "passage" else found.kv.context_hash

    def _find(self, key: str, span: Span, read: bool) -> Loaded:
        if not read:  # only its header: where it is and where it was computed
            entry, tier = self.kv.open_key(key, span.ids)
            meta = None if entry is None else _Meta(entry.position, entry.context_hash)
            if entry is not None and not isinstance(entry, ChunkKV):
                entry.close()
            return Loaded(list(span.ids), meta, tier, span.start)  # type: ignore[arg-type]
        kv, tier = (self.kv.open_key if self.pipeline else self.kv.lookup_key)(key, span.ids)
        return Loaded(list(span.ids), kv, tier, span.start)

    # ---- the prefill's segments ------------------------------------------------------------------

    def segments(self, plan: Plan, loaded: Sequence[Loaded]) -> tuple[list, list[int]]:
        """(the prefill's segments: KV read or fresh spans, the ids computed with the question)."""
        tail = plan.tail
        blender = self.kv.blender
        segments = [blender.fresh(span.ids, span.start) if read.kv is None
                    else _exact(read.kv, span.after) if span.source == "exact" and read.tier != COMPUTED
                    else read.kv  # (a span the loading controller made fresh is never exact)
                    for span, read in zip(plan.spans[:tail], loaded[:tail])]
        for read in loaded[tail:]:
            read.close()
        return segments, [t for s in plan.spans[tail:] for t in s.ids] + list(plan.suffix)

    # ---- after the prefill -----------------------------------------------------------------------

    def store(self, plan: Plan, loaded: Sequence[Loaded], prefill: Prefill) -> int:
        """Store what the next prompt may need, cut from this prefill's KV (no compute): each computed span under
        its key, each blended span of the client's text under its chain key (the same prompt again is an exact
        prefix). Returns the entries handed over. (A full-prefill fallback's KV is the model's own: stored too.)
        Each is handed to the store's writer thread (put_nowait): encoded and written off the model thread. Once
        the writer refuses one (its queue has no room: counted there, by bound), no more of this prompt is handed
        over: what is stored is the prompt's first spans, a clean prefix for its repeat, not scattered pieces."""
        written: set[str] = set()
        for span, read in zip(plan.spans, loaded):
            # an entry that failed to load: again; one found that the plan computed whole: as found (blended), so
            # a shared passage's entry stays the one the plan priced, and its repeat is planned (and answered) alike
            had = "compute" if read.tier == COMPUTED else "blended" if read.tier == WHOLE else span.source
            if not _kept(span, had):
                continue
            entries, kv = self.entries(span, span.after, plan.tenant, plan.collection), None
            for context, key in entries[:1] if had == "blended" else entries:  # blended: as prompted only
                if key not in written:  # one copy out of the prefill, named by each entry's context
                    kv = span_kv(prefill, span, context, self.fingerprint) if kv is None \
                        else replace(kv, context_hash=context)
                    if not self.kv.store.put_nowait(key, kv):
                        return len(written)  # backpressure: the writer is full
                    written.add(key)
            if span.kind == "message" and had != "blended":  # stored under its content key: found by its ending
                self._remember_ending(span.ids)
            if self.settings.chunking == "windows" and len(span.ids) == self.settings.window_tokens:
                self._remember_window(span.ids)
        return len(written)

    def _remember_window(self, ids: Sequence[int]) -> None:
        h = next(iter(_rolling(ids, len(ids))))
        self._windows.pop(h, None)
        self._windows[h] = None
        if len(self._windows) > WINDOW_INDEX_MAX:
            del self._windows[next(iter(self._windows))]

    def observe(self, plan: Plan, loaded: Sequence[Loaded], prefill: Prefill) -> None:
        """Feed a blended prefill's measured costs to the rates blends are priced by (app.engine.loading): its
        layers' time per token-layer run (a question pass is priced at it), its waits for reads and its layout per
        blended span-layer."""
        p = prefill.stats
        if self.costs is None or p.fallback is not None:
            return
        layers, timings = self.kv.blender.num_layers, p.timings_ms
        run = p.prompt_tokens - p.cached_tokens + p.recomputed_tokens  # the rows the layers ran
        layers_ms = timings.get("layers_selected", timings.get("layers", 0.0)) + timings.get("layers_full", 0.0)
        blended = sum(s.source == "blended" and r.tier != COMPUTED for s, r in zip(plan.spans, loaded)) * layers
        self.costs.observe(run * layers, max(layers_ms - p.load_wait_ms, 0.0) / 1000,
                           spans=(blended, (p.load_wait_ms + timings.get("assemble", 0.0)) / 1000))

    @staticmethod
    def key_uses(plan: Plan) -> list[KeyUse]:
        """Each span's entry: the one read, or the one it is stored under."""
        return [KeyUse(s.key, len(s.ids), s.message, s.source != "compute") for s in plan.spans]

    @staticmethod
    def fill_stats(stats: QueryStats, plan: Plan, loaded: Sequence[Loaded], prefill: Prefill, mode: str) -> None:
        """Tokens read from the store and not recomputed (cached), read and recomputed, and each span's source."""
        p = prefill.stats
        stats.prompt_tokens, stats.fallback, stats.load_wait_ms = p.prompt_tokens, p.fallback, p.load_wait_ms
        stats.recompute_ratio = 1.0 if mode == "full" else p.ratio
        messages = [s for s in plan.spans if s.kind == "message"]
        stats.conversation_tokens = sum(len(s.ids) for s in messages)
        stats.dropped_messages, stats.plan = plan.dropped, plan.choice
        if mode == "full":
            return
        selected = set(prefill.selected.tolist())
        read = [(s, r) for s, r in zip(plan.spans[:plan.tail], loaded) if s.source != "compute" and r.tier != COMPUTED]
        stats.spans = [{"kind": s.kind, "tokens": len(s.ids), "message": s.message,
                        "kv": s.source if r.tier != COMPUTED else "compute", "tier": r.tier}
                       for s, r in zip(plan.spans, loaded)]
        if p.fallback is not None:
            return  # a full prefill: nothing read
        recomputed = {id(s): sum(1 for t in range(s.start, s.end) if t in selected) for s, _ in read}
        stats.recomputed_tokens = sum(recomputed.values())
        stats.cached_tokens = sum(len(s.ids) - recomputed[id(s)] for s, _ in read)
        stats.exact_tokens = p.exact_tokens
        stats.conversation_cached_tokens = sum(len(s.ids) - recomputed[id(s)] for s, _ in read if s.kind == "message")
        stats.store_hits = {}
        for span, r in zip(plan.spans, loaded):
            if span.kind == "passage":
                tier = r.tier if span.source != "compute" and r.tier else COMPUTED
                stats.store_hits[tier] = stats.store_hits.get(tier, 0) + 1


@dataclass(frozen=True)
class _Meta:
    position: int
    context_hash: str


def _exact(kv: ChunkKV | LayerSource, before: str) -> ChunkKV | LayerSource:
    """An entry the plan found exact (its chain key names what precedes it here, tenant included), labelled so
    for the blender, which takes as exact prefix the segments computed after exactly the tokens before them."""
    if isinstance(kv, ChunkKV):
        return replace(kv, context_hash=before)
    kv.context_hash = before  # an opened entry: its own, read once by this prefill
    return kv


def _kept(span: Span, had: str) -> bool:
    """Whether the store keeps `span` after a prefill that had it `had` (exact, blended, compute): not an exact one,
    nor a shared passage blended here (its entry stays the one computed after the head), nor the standard head
    (kept exact by ChunkKVCache, stored at warm-up)."""
    return not (had == "exact" or (had == "blended" and span.shared) or (span.kind == "head" and span.shared))


def _salted(context: str, tenant: str) -> str:
    return hashlib.sha256(f"{context}\x00tenant={tenant}".encode()).hexdigest() if tenant else context


def _shared_ending(a: np.ndarray, b: np.ndarray) -> int:
    """How many last ids `a` and `b` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[len(a) - n:][::-1] != b[len(b) - n:][::-1])
    return int(differ[0]) if len(differ) else n


def ending_kv(kv: ChunkKV, n: int) -> ChunkKV:
    """The KV of an entry's last n tokens (their keys rotated for their own positions, as stored)."""
    skip = kv.num_tokens - n
    keys, values = kv.keys[:, :, skip:].contiguous(), kv.values[:, :, skip:].contiguous()  # [L, H, n, D]
    return ChunkKV(keys, values, kv.token_ids[skip:], kv.position + skip, kv.context_hash, kv.fingerprint)


def span_kv(prefill: Prefill, span: Span, context: str, fingerprint: str) -> ChunkKV:
    """The KV of `span` cut from the prefill's cache (the store names it by `context`, its entry's)."""
    start, end = span.start, span.end
    keys = torch.stack([layer.keys[0, :, start:end] for layer in prefill.cache.layers]).clone()     # [L, H, T, D]
    values = torch.stack([layer.values[0, :, start:end] for layer in prefill.cache.layers]).clone()
    return ChunkKV(keys, values, torch.tensor(span.ids), start, context, fingerprint)


def _rolling(ids: Sequence[int], w: int):
    """A polynomial hash of every w-token window of `ids`, in order (mod 2^61 - 1)."""
    mod, base = (1 << 61) - 1, 1_000_003
    top, h = pow(base, w - 1, mod), 0
    for i, t in enumerate(ids):
        if i >= w:
            h = (h - (ids[i - w] + 1) * top) % mod
        h = (h * base + t + 1) % mod
        if i >= w - 1:
            yield h
