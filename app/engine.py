"""RagEngine: question → retrieve top-k → chunk KV (store or precompute) → blended prefill → decode.

One engine owns the model, which is not thread-safe: callers serialize requests (the server
runs them on one worker thread). `stream()` yields text deltas and finally a QueryResult;
`answer()` collects them.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator, Literal

from app.components import Components
from app.config import Settings
from app.explain import Explain, explain_prompt
from blend import ChunkKV, Prefill, SamplingParams, TextStream

Mode = Literal["blend", "full", "reuse"]


class RequestError(ValueError):
    """The request cannot be served as asked (HTTP 400)."""


@dataclass
class QueryParams:
    question: str
    top_k: int | None = None
    mode: Mode = "blend"
    ratio: float | None = None
    selection: str | None = None  # a blend.selection policy; None: blend.selection
    max_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    explain_tokens: int = 0  # > 0: attach an Explain of the prompt, listing at most this many tokens


@dataclass
class Source:
    doc_id: str
    chunk_id: int
    title: str | None
    score: float
    text: str


@dataclass
class QueryStats:
    mode: str
    ttft_ms: float = 0.0
    total_ms: float = 0.0
    retrieve_ms: float = 0.0
    kv_load_ms: float = 0.0
    prefill_ms: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    recomputed_tokens: int = 0
    recompute_ratio: float = 1.0
    selection: str | None = None
    completion_tokens: int = 0
    store_hits: dict[str, int] = field(default_factory=dict)  # chunks per tier they came from; "computed" = miss
    fallback: str | None = None  # why a blend ran as full prefill
    queue_ms: float = 0.0  # time waiting for the model worker (set by the server)


@dataclass
class QueryResult:
    answer: str
    sources: list[Source]
    stats: QueryStats
    finish_reason: str
    explain: Explain | None = None

    def to_dict(self) -> dict:
        return asdict(self)


class RagEngine:
    def __init__(self, settings: Settings, components: Components | None = None):
        self.settings = settings
        self.parts = components or Components(settings)

    def answer(self, params: QueryParams) -> QueryResult:
        for event in self.stream(params):
            if isinstance(event, QueryResult):
                return event
        raise RuntimeError("generation ended without a result")

    def stream(self, params: QueryParams, cancelled: Callable[[], bool] = lambda: False
               ) -> Iterator[str | QueryResult]:
        limits, parts = self.settings.limits, self.parts
        start = time.perf_counter()
        stats = QueryStats(mode=params.mode)

        # 1. Retrieve, and lay the prompt out as token ids: head | passages | suffix (no KV yet).
        hits = parts.retriever.search(params.question, params.top_k or self.settings.retrieval.top_k)
        passages = [parts.kv_cache.passage_ids(h.chunk.token_ids, h.title) for h in hits]
        suffix = parts.prompt.suffix_ids(params.question)
        stats.retrieve_ms = _ms(start)
        self._check_length(len(parts.kv_cache.head_ids) + sum(map(len, passages)) + len(suffix), params)

        # 2. Chunk KVs: the prompt head, then one per passage (store hit or precompute).
        t = time.perf_counter()
        if params.mode == "full":
            segments: list[ChunkKV] = []
        else:
            hits_by_tier: Counter[str] = Counter()
            segments = [parts.kv_cache.head()]
            for ids in passages:
                kv, tier = parts.kv_cache.get_or_compute(ids)
                segments.append(kv)
                hits_by_tier[tier] += 1
            stats.store_hits = dict(hits_by_tier)
        stats.kv_load_ms = _ms(t)

        # 3. Prefill.
        t = time.perf_counter()
        if params.mode == "full":
            prompt_ids = parts.kv_cache.head_ids + [i for ids in passages for i in ids] + suffix
            prefill = parts.blender.full_prefill(prompt_ids)
        else:
            ratio = 0.0 if params.mode == "reuse" else (
                self.settings.blend.ratio if params.ratio is None else params.ratio)
            prefill = parts.blender.prefill(segments, suffix, ratio, selection=params.selection)
            stats.selection = params.selection or parts.blender.selection
        stats.prefill_ms = _ms(t)
        _fill_prefill_stats(stats, prefill, params.mode)

        # 4. Decode, streaming text; the first token's arrival is the TTFT.
        sampling = SamplingParams(max_new_tokens=params.max_tokens or limits.default_max_new_tokens,
                                  temperature=params.temperature, top_p=params.top_p, stop=params.stop,
                                  seed=params.seed)
        text = TextStream(parts.tokenizer, stop=params.stop, eos_ids=parts.blender.eos_ids)
        tokens = parts.blender.decode(prefill, sampling)
        for delta in text.feed(self._first_token_timed(tokens, stats, start, cancelled)):
            yield delta
        if cancelled():
            text.finish_reason = "cancelled"
        stats.completion_tokens = len(text.tokens)
        stats.total_ms = _ms(start)
        sources = [Source(h.chunk.doc_id, h.chunk.id, h.title, round(float(h.score), 4), h.chunk.text) for h in hits]
        explain = None
        if params.explain_tokens:  # built after the answer: it never delays the first token
            explain = self._explain(passages, suffix, prefill, params.explain_tokens)
        yield QueryResult(text.text.strip(), sources, stats, text.finish_reason or "length", explain)

    def _explain(self, passages: list[list[int]], suffix: list[int], prefill: Prefill, max_tokens: int) -> Explain:
        b = self.settings.blend
        return explain_prompt(self.parts.tokenizer, self.parts.kv_cache.head_ids, passages, suffix, prefill,
                              score=f"squared L2 deviation of the {b.deviation}s at layer {b.check_layer}",
                              max_tokens=max_tokens)

    @staticmethod
    def _first_token_timed(tokens: Iterator[int], stats: QueryStats, start: float,
                           cancelled: Callable[[], bool]) -> Iterator[int]:
        for i, token in enumerate(tokens):
            if i == 0:
                stats.ttft_ms = _ms(start)
            if cancelled():
                return
            yield token

    def _check_length(self, prompt_len: int, params: QueryParams) -> None:
        limit = getattr(self.parts.llm.model.config, "max_position_embeddings", None)
        need = prompt_len + (params.max_tokens or self.settings.limits.default_max_new_tokens)
        if limit and need > limit:
            raise RequestError(f"prompt of {prompt_len} tokens plus max_tokens exceeds the model's "
                               f"{limit}-token context; lower top_k or max_tokens")


def _fill_prefill_stats(stats: QueryStats, prefill: Prefill, mode: str) -> None:
    s = prefill.stats
    stats.prompt_tokens, stats.cached_tokens = s.prompt_tokens, s.cached_tokens
    stats.recomputed_tokens = s.recomputed_tokens
    stats.recompute_ratio = 1.0 if mode == "full" else s.ratio
    stats.fallback = s.fallback


def _ms(since: float) -> float:
    return round((time.perf_counter() - since) * 1000, 2)


def run_ask(settings: Settings, question: str, *, top_k: int | None, mode: str, ratio: float | None,
            max_tokens: int | None) -> int:
    """`ragblend ask`: print the answer, its sources and timings."""
    import sys

    engine = RagEngine(settings)
    for event in engine.stream(QueryParams(question, top_k=top_k, mode=mode, ratio=ratio, max_tokens=max_tokens)):
        if isinstance(event, str):
            sys.stdout.write(event)
            sys.stdout.flush()
        else:
            print("\n\nsources:")
            for src in event.sources:
                print(f"  [{src.score:.3f}] {src.doc_id}#{src.chunk_id} {src.title or ''}")
            s = event.stats
            print(f"\nmode={s.mode} ttft={s.ttft_ms:.0f}ms total={s.total_ms:.0f}ms prompt={s.prompt_tokens} "
                  f"cached={s.cached_tokens} recomputed={s.recomputed_tokens} store={s.store_hits}")
    engine.parts.close()
    return 0
