"""RagEngine: a request as retrieve → plan → prefill → decode → store.

The engine owns the model, which is not thread-safe. A request is data for blend.driver (the server's scheduler,
app.serving.scheduler, runs several at a time): `request(params)` is its model work (`Query`: `prepare`, the plan
and store reads, off the model thread; `prefill`, resumable a slice per layer chunk, ending in its decoding
sequence; `finish`, storing the spans after its last token), and `output(params)` its output side (`QueryOutput`,
off the model thread: its token ids to text deltas, stop strings, tool calls and the QueryResult). The runner
decodes its tokens, batched with the other requests'. `stream()` runs one request alone through the same
schedule and runner (the CLI, tests), and `answer()` collects it.

The prompt is given as parts: a query's is head | passages | question (blend.prompt); a chat's is
    head (system turn) | message | message | ... | [user turn opening | passages | question]
the bracket only with retrieval (then the last user message is the question, after its passages), else the
assistant turn's opening alone. app.engine.planner cuts the parts into spans and decides, once, where each span's KV
comes from (an exact entry, a blended one, or computed in the prefill itself); after the prefill it stores
the spans the store lacked, cut from the prefill's own KV, before the result is sent (so every key the result
names is stored). Nothing is computed but the prefill and the decode. When the messages do not fit the
context, the oldest are dropped first; with blend.ratio auto the loading controller (app.engine.loading) picks the
ratio.
"""
from __future__ import annotations

import time
from dataclasses import replace
from functools import cached_property
from typing import Any, Callable, Generator, Iterator, Protocol

from app.config import Settings
from app.engine.conversation import CHARS_PER_TOKEN_BOUND
from app.engine.explain import Explain, explain_prompt
from app.engine.kv import ChunkKVCache
from app.engine.loading import LoadingControl
from app.engine.planner import Loaded, Part, Plan, Planner
from app.engine.query import (
    SYSTEM_ROLES,
    QueryParams,
    QueryResult,
    QueryStats,
    RequestError,
    Source,
    message_text,
)
from app.engine.tool_calls import split_tool_calls
from app.engine.usage import COMPUTED
from blend import Blender, DecodeRuntime, LoadedModel, Prefill, PromptFormat, SamplingParams, StoredSpans, TextStream
from blend.cache import RoundTrip
from blend.controller import Calibration
from blend.decode import Decoding
from blend.driver import run_alone
from blend.grammar import Constraint, GrammarError, Grammars
from blend.prompt import ChatTemplateError
from blend.selection import get_policy
from retrieval import Retriever


class Parts(Protocol):
    """What the engine runs on, built by app.components (the engine never builds its parts)."""

    llm: LoadedModel
    tokenizer: Any
    blender: Blender
    runtime: DecodeRuntime
    grammars: Grammars
    prompt: PromptFormat
    kv_cache: ChunkKVCache
    retriever: Retriever
    loading: LoadingControl
    stored_round_trip: RoundTrip | None


class RagEngine:
    def __init__(self, settings: Settings, parts: Parts):
        self.settings, self.parts = settings, parts

    @property
    def calibration(self) -> Calibration:
        """The loading controller's measured recompute cost and tier bandwidths (blend.ratio: auto)."""
        return self.parts.loading.calibration

    def answer(self, params: QueryParams) -> QueryResult:
        results = [event for event in self.stream(params) if isinstance(event, QueryResult)]
        if not results:
            raise RuntimeError("generation ended without a result")
        return results[-1]

    def stream(self, params: QueryParams, cancelled: Callable[[], bool] = lambda: False
               ) -> Iterator[str | QueryResult]:
        """Text deltas, then the QueryResult: one request run alone, on this thread (blend.driver.run_alone: the
        server's schedule and runner, one request)."""
        return run_alone(self.request(params), self.output(params), self.parts.runtime.advance,
                         self.parts.blender.num_layers, cancelled)

    def request(self, params: QueryParams) -> Query:
        """One request's model work, for the driver (blend.driver): the server's runner, or `stream`."""
        return Query(self, params)

    def output(self, params: QueryParams) -> QueryOutput:
        """One request's output side: its token ids to text deltas and its QueryResult, off the model thread."""
        eos = frozenset() if params.ignore_eos else self.parts.runtime.eos_ids
        return QueryOutput(params, TextStream(self.parts.tokenizer, stop=params.stop, eos_ids=eos))

    @cached_property
    def planner(self) -> Planner:
        b = self.settings.blend  # (blend.ratio auto: priced at its floor)
        return Planner(self.parts.kv_cache, self.settings.planner, pipeline=b.pipeline, costs=self.parts.loading,
                       ratio=b.ratio_floor if b.ratio == "auto" else b.ratio)

    def prefill(self, params: QueryParams, plan: Plan, loaded: list[Loaded], stats: QueryStats
                ) -> Generator[int | None, None, Prefill]:
        """Steps 2-3 of a request, on the model thread: its prefill from its plan and the KV read (step 1, `plan`,
        off the model thread); the benchmarks score the prefill. Yields after each slice (its token-layers)."""
        parts = self.parts
        # 2. Prefill, a slice per layer chunk (server.prefill_chunk_tokens): the spans read (RoPE-shifted,
        #    blended), the others computed in it.
        t = time.perf_counter()
        if params.mode == "full":
            prompt_ids = [i for s in plan.spans for i in s.ids] + list(plan.suffix)
            prefill = yield from parts.blender.prefill_steps([], prompt_ids, 1.0)
        else:
            ratio = 0.0 if params.mode in ("reuse", "prefix") else params.ratio
            reads = [r for s, r in zip(plan.spans[:plan.tail], loaded) if r.kv is not None]
            if ratio is None and self.settings.blend.ratio == "auto":
                suffix_tokens = sum(len(s.ids) for s in plan.spans[plan.tail:]) + len(plan.suffix)
                ratio, stats.loading = yield from parts.loading.ratio(reads, suffix_tokens, params.selection,
                                                                      self._fresh)
            elif ratio is None:
                ratio = self.settings.blend.ratio
            segments, suffix = self.planner.segments(plan, loaded)
            # the spans the store will keep, attended to as a repeat of the prompt will read them back
            stored = StoredSpans(self.planner.stored(plan), parts.stored_round_trip) if parts.stored_round_trip \
                else None
            prefill = yield from parts.blender.prefill_steps(
                segments, suffix, ratio, selection=params.selection, pipeline=self.settings.blend.pipeline,
                recompute=lambda i: self._fresh(loaded[i]), stored=stored)
            stats.selection = params.selection or parts.blender.selection
            for span, read in zip(plan.spans, loaded):  # where each retrieved chunk's KV came from (app.engine.usage)
                if span.kind == "passage":
                    source = read.tier if span.source != "compute" else COMPUTED
                    parts.kv_cache.served(span.ids, source, plan.collection)
        stats.prefill_ms = _ms(t)
        self.planner.fill_stats(stats, plan, loaded, prefill, params.mode)
        self.planner.observe(plan, loaded, prefill)  # live costs, for the planner and the loading controller
        return prefill

    def _fresh(self, read: Loaded):
        """A span whose stored KV failed to load mid-prefill (damaged, gone), or that the loading controller finds
        cheaper to recompute than to load: computed in the prefill instead (and stored after it)."""
        read.tier = COMPUTED
        return self.parts.blender.fresh(read.ids, read.start)

    # ---- the plan, off the model thread ------------------------------------------------------------

    def lookup(self, params: QueryParams) -> Plan:
        """The request's plan as its Query would make it, each span's source and tier saying where its KV is
        (entries' headers read, no KV, nothing computed): POST /v1/cache/lookup."""
        max_tokens = params.max_tokens or self.settings.limits.default_max_new_tokens
        return self.plan(params, max_tokens, QueryStats(mode=params.mode), read=False)[0]

    def plan(self, params: QueryParams, max_tokens: int, stats: QueryStats, read: bool = True
             ) -> tuple[Plan, list[Loaded]]:
        """Step 1 of a request, off the model thread: retrieve, cut the prompt into spans, read their KV from the
        store (with `read`; else only where each span's KV is)."""
        parts, t = self.parts, time.perf_counter()
        hits = parts.retriever.search(params.retrieval_query or params.question,
                                      params.top_k or self.settings.retrieval.top_k,
                                      tenant=params.collection) if params.retrieve else []
        passages = [Part("passage", tuple(parts.kv_cache.passage_ids(h.chunk.token_ids, h.title))) for h in hits]
        stats.retrieve_ms = _ms(t)
        if params.prompt_ids:  # a raw prompt (/v1/completions): no template; its last token computed for the logits
            ids = params.prompt_ids
            given, suffix, dropped = ([Part("message", ids[:-1], 0)] if len(ids) > 1 else []), list(ids[-1:]), 0
        elif params.messages:
            try:
                given, suffix, dropped = self._chat_parts(params, passages, max_tokens)
            except ChatTemplateError as exc:
                raise RequestError(str(exc)) from exc
        else:
            given, suffix, dropped = [Part("head", tuple(parts.prompt.head_ids))], parts.prompt.suffix_ids(
                params.question), 0
        given += passages
        prompt_tokens = sum(len(p.ids) for p in given) + len(suffix)
        self._check_length(prompt_tokens, max_tokens)
        budget = self.settings.limits.max_prompt_tokens
        if prompt_tokens > budget:  # the route checked the messages; the passages are known only now
            raise RequestError(f"prompt of {prompt_tokens} tokens (messages, passages and question) exceeds "
                               f"limits.max_prompt_tokens ({budget}); lower top_k or shorten the messages")
        t = time.perf_counter()
        plan, loaded = self.planner.plan(given, suffix, mode=params.mode, tenant=params.tenant, read=read,
                                         collection=params.collection, ratio=params.ratio, hits=tuple(hits),
                                         dropped=dropped)
        stats.kv_load_ms = _ms(t)
        self._check_price(params, plan, loaded, prompt_tokens)
        return plan, loaded

    def _check_price(self, params: QueryParams, plan: Plan, loaded: list[Loaded], prompt_tokens: int) -> None:
        """The exact price, now that the store is looked up (with the pipeline, only the entries' headers are read:
        no KV yet, no layer run): tokens computed, tokens read, the pieces (messages, or the question, and
        passages). Over limits.max_prompt_tokens: a 400, the opened entries closed."""
        limits = self.settings.limits
        read = sum(len(r.ids) for r in loaded if r.kv is not None)
        pieces = (len(params.messages) if params.messages else 1) + len(plan.hits)
        price = limits.price(computed=prompt_tokens - read, read=read, pieces=pieces)
        if price > limits.max_prompt_tokens:
            for entry in loaded:
                entry.close()
            raise RequestError(f"prompt work priced at {price} tokens, over limits.max_prompt_tokens "
                               f"({limits.max_prompt_tokens}): {prompt_tokens - read} tokens computed, {read} read "
                               f"from the store (each {limits.read_token_cost} of a computed one, "
                               f"limits.read_token_cost), {pieces} pieces (messages and passages, each "
                               f"{limits.piece_cost_tokens}, limits.piece_cost_tokens); lower top_k or shorten the "
                               f"messages")

    def _chat_parts(self, params: QueryParams, passages: list[Part], max_tokens: int
                    ) -> tuple[list[Part], list[int], int]:
        """A chat's head, message parts (the newest messages that fit the context) and opening, its suffix, and
        how many messages were dropped."""
        prompt, template = self.parts.prompt, self.parts.prompt.chat
        system = "\n\n".join(message_text(m) for m in params.messages
                             if m["role"] in SYSTEM_ROLES and message_text(m)) or None
        indexed = [(i, m) for i, m in enumerate(params.messages) if m["role"] not in SYSTEM_ROLES]
        # a prefill (the assistant's message last) goes at the end: the assistant turn rendered open with it, after
        # the messages (the layout's tail) or after the question (its suffix)
        prefill = indexed.pop()[1] if params.prefill else None
        question = None
        if params.retrieve:  # the last user message with text is the question, after its passages
            q = max((k for k, (_, m) in enumerate(indexed) if m["role"] == "user" and message_text(m)), default=None)
            if q is None:
                raise RequestError("retrieval needs a user message with text (the question)")
            question = indexed.pop(q)[1]
        opening = template.opening_ids(system) if params.retrieve else []
        keep = 0 if params.retrieve else 1  # without retrieval the last message is what is answered
        limit = self._context_limit()
        start = within_chars(indexed, limit, keep)
        open_tail = None if question else prefill  # (with a question, the tail is unused)
        layout = template.layout([m for _, m in indexed[start:]], params.tools, system, open_tail)
        suffix = prompt.suffix_ids(message_text(question), system, params.prefill) if question else layout.tail
        fixed = len(opening) + sum(len(p.ids) for p in passages) + len(suffix) + max_tokens
        while limit and len(layout.head) + sum(map(len, layout.messages)) + fixed > limit \
                and start < len(indexed) - keep:  # drop the oldest messages, as many as the excess
            excess, drop = len(layout.head) + sum(map(len, layout.messages)) + fixed - limit, 0
            while excess > 0 and drop < min(len(layout.messages), len(indexed) - keep - start):
                excess, drop = excess - len(layout.messages[drop]), drop + 1
            start += max(drop, 1)
            layout = template.layout([m for _, m in indexed[start:]], params.tools, system, open_tail)
        kept = indexed[start:]
        numbers = [i for i, _ in kept] if layout.split else [i for i, _ in kept[-1:]] * len(layout.messages)
        given = [Part("head", tuple(layout.head))] + [Part("message", tuple(ids), number)
                                                      for ids, number in zip(layout.messages, numbers)]
        if opening:
            given.append(Part("opening", tuple(opening)))
        return given, suffix, start

    def _check_length(self, prompt_len: int, max_tokens: int) -> None:
        limit = self._context_limit()
        if limit and prompt_len + max_tokens > limit:
            what = "decode KV pool's" if limit == self.parts.runtime.max_len else "model's"
            raise RequestError(f"prompt of {prompt_len} tokens plus max_tokens ({max_tokens}) exceeds the {what} "
                               f"{limit}-token context; lower top_k or max_tokens")

    def _context_limit(self) -> int | None:
        """Positions a request may fill: the model's context, at most a decode pool slot (blend.pool)."""
        model = getattr(self.parts.llm.model.config, "max_position_embeddings", None)
        return min(x for x in (model, self.parts.runtime.max_len) if x)

    # ---- after the answer ----------------------------------------------------------------------------

    def _explain(self, plan: Plan, prefill: Prefill, max_tokens: int) -> Explain:
        first = next((k for k, s in enumerate(plan.spans) if s.kind == "passage"), plan.tail)
        passages = [s for s in plan.spans[first:] if s.kind == "passage"]
        head = [i for s in plan.spans[:first] for i in s.ids]  # the head and any messages
        rest = [i for s in plan.spans[first + len(passages):] for i in s.ids] + list(plan.suffix)
        return explain_prompt(self.parts.tokenizer, head, [s.ids for s in passages], rest, prefill,
                              score=self._score_meaning(prefill), max_tokens=max_tokens)

    def _score_meaning(self, prefill: Prefill) -> str:
        """What the scores of the policy that ran measure (its docstring), for the page's legend."""
        b = self.settings.blend
        policy = get_policy(prefill.stats.selection or b.selection)
        detail = f" (the {b.deviation}s at layer {b.check_layer})" if policy.deviation else ""
        return f"{policy.name}: {policy.doc}{detail}"


class Query:
    """One request's model work (blend.driver.Work): its plan off the model thread, then its prefill and the
    decoding sequence it starts, then the spans the store lacked, stored after its last token."""

    def __init__(self, engine: RagEngine, params: QueryParams):
        self.engine, self.params, self.start = engine, params, time.perf_counter()
        self.stats = QueryStats(mode=params.mode)
        self.max_tokens = params.max_tokens or engine.settings.limits.default_max_new_tokens
        self.plan: Plan | None = None
        self.loaded: list[Loaded] = []
        self.prefilled: Prefill | None = None
        self.constraint: Constraint | None = None

    def prepare(self) -> None:
        # 1. Off the model thread: the answer's grammar (tool_choice, response_format: app.engine.tool_calls;
        #    the server hands it in compiled), then retrieve, cut the prompt into spans, read their KV.
        grammar = self.params.grammar
        try:
            self.constraint = self.engine.parts.grammars.constraint(grammar) if grammar else None
        except GrammarError as exc:
            raise RequestError(str(exc)) from None
        prompt = self.engine.parts.prompt
        if self.constraint and self.params.prefill and \
                not self.constraint.start_with(prompt.encode(prompt.plain(self.params.prefill))):
            raise RequestError("messages: the assistant's prefill (the last message) is not a start of an answer "
                               "the request allows (its tools, tool_choice or output schema)")
        self.plan, self.loaded = self.engine.plan(self.params, self.max_tokens, self.stats)

    def prefill(self) -> Generator[int | None, None, Decoding]:
        engine, params, parts, constraint = self.engine, self.params, self.engine.parts, self.constraint
        # 2-3. The prefill, a slice per layer chunk.
        self.prefilled = yield from engine.prefill(params, self.plan, self.loaded, self.stats)
        # 4. Decode in a KV pool slot (the runner gives it back when the request ends): the first token is chosen
        #    here, the others by the runner's batched steps (DecodeRuntime.advance).
        sampling = SamplingParams(max_new_tokens=self.max_tokens, temperature=params.temperature, top_p=params.top_p,
                                  stop=params.stop, seed=params.seed, top_logprobs=params.top_logprobs)
        eos = frozenset() if params.ignore_eos else parts.runtime.eos_ids
        sequence = parts.runtime.start(self.prefilled, sampling, constraint, eos)
        self.stats.ttft_ms = _ms(self.start)
        return sequence

    def finish(self, sequence: Decoding, reason: str) -> QueryResult:
        """After the last token: the result as the model thread knows it (its answer, calls, stop string and token
        count are the output side's: QueryOutput)."""
        engine, params, plan = self.engine, self.params, self.plan
        self.stats.total_ms = _ms(self.start)
        sources = [Source(h.chunk.doc_id, h.chunk.id, h.title, round(float(h.score), 4), h.chunk.text)
                   for h in plan.hits]
        explain = None
        if params.explain_tokens:  # built after the answer: it never delays the first token
            explain = engine._explain(plan, self.prefilled, params.explain_tokens)
        # 5. Store the spans the store lacked, cut from the prefill (no compute): every key in kv_keys is stored.
        if params.mode != "full":
            engine.planner.store(plan, self.loaded, self.prefilled)
        uses = engine.planner.key_uses(plan) if params.mode != "full" else []
        logprobs = sequence.logprobs if params.top_logprobs is not None else None
        return QueryResult("", sources, self.stats, reason, explain, uses, logprobs=logprobs)


class QueryOutput:
    """A query's output side (blend.driver.Output), off the model thread: its token ids become text deltas
    (TextStream: incremental, held back where a stop string may begin); the model thread's last record becomes
    the QueryResult with the answer, its tool calls, the stop string and the tokens shown."""

    def __init__(self, params: QueryParams, text: TextStream):
        self.params, self.text = params, text

    @property
    def stopped(self) -> bool:
        return self.text.stop_sequence is not None

    def feed(self, item: list[int] | QueryResult) -> list[str | QueryResult]:
        if isinstance(item, QueryResult):
            return [*self.text.finish(), self._result(item)]
        return [delta for token in item for delta in self.text.push(token)]

    def _result(self, done: QueryResult) -> QueryResult:
        text, params = self.text, self.params
        # a raw prompt's continuation as it is; a prefill's with the space it may start with
        answer = text.text if params.prompt_ids else text.text.rstrip() if params.prefill else text.text.strip()
        content, calls = split_tool_calls(answer, params.prefill) if params.tool_calls else (answer, [])
        done.stats.completion_tokens = len(text.tokens)  # (no eos; none decoded past a stop string)
        logprobs = None if done.logprobs is None else done.logprobs[:len(text.tokens)]
        return replace(done, answer=content, tool_calls=calls, finish_reason="stop" if self.stopped else
                       done.finish_reason, stop_sequence=text.stop_sequence, logprobs=logprobs)


def within_chars(indexed: list[tuple[int, dict]], limit: int | None, keep: int) -> int:
    """The first message worth rendering: the older ones cannot fit a `limit`-token context on their text
    alone (no token holds more than CHARS_PER_TOKEN_BOUND characters). The last `keep` are always kept."""
    chars = 0
    for start in range(len(indexed) - 1, -1, -1):
        chars += len(message_text(indexed[start][1]))
        if limit and chars > CHARS_PER_TOKEN_BOUND * limit and start < len(indexed) - keep:
            return start + 1
    return 0


def _ms(since: float) -> float:
    return round((time.perf_counter() - since) * 1000, 2)
