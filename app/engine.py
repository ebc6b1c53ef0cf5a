"""RagEngine: question → retrieve top-k → chunk KV (store or precompute) → blended prefill → decode.

The engine owns the model, which is not thread-safe. `program(params)` is one request as a generator
that blend.driver's Driver steps on the model thread (the server's scheduler, app.scheduler, several at a
time): it yields text deltas and finally a QueryResult for the client, and directives in between —
retrieval and store reads offloaded to another thread, one slice per prefill layer or precomputed piece,
one DecodeStep per token (batched with the other requests'). `stream()` runs one program alone through the
same driver, in one slot (the CLI, tests), and `answer()` collects it.

The prompt: head | conversation | passages | question (blend.prompt). A chat request's earlier turns
form the conversation, an exact prefix whose KV is stored per exchange: after sending its answer, the
program stores the KV of the exchange it just had, so the next turn reads its whole conversation from
the store and computes only its passages' repair and the new question.
When the conversation does not fit the context, its oldest exchanges are dropped first (app.conversation);
with blend.ratio auto the loading controller (app.loading) picks the ratio.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Generator, Iterator, Literal

from app.components import Components
from app.config import Settings
from app.conversation import fit_conversation
from app.explain import Explain, explain_prompt
from blend import ChunkKV, Prefill, SamplingParams, TextStream
from blend.controller import Calibration
from blend.decode import decode_loop
from blend.driver import Driver, Offload
from blend.pipeline import LayerSource
from blend.selection import get_policy
from retrieval.retriever import Hit

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
    # A chat: the client's system message, the earlier turns as (role, text), role "user" or "assistant",
    # oldest first, and the text to retrieve with (default: the question).
    system: str | None = None
    turns: tuple[tuple[str, str], ...] = ()
    retrieval_query: str | None = None
    remember: bool = False  # store this exchange's KV for the next turn (chat)
    retrieve: bool = True  # False: no passages, the prompt is the conversation alone (/v1/messages)
    ignore_eos: bool = False  # generate max_tokens whatever the model says (benchmarks)


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
    cached_tokens: int = 0  # prompt tokens whose KV was read from the store (not computed for this request)
    recomputed_tokens: int = 0
    recompute_ratio: float = 1.0
    selection: str | None = None
    completion_tokens: int = 0
    store_hits: dict[str, int] = field(default_factory=dict)  # passages per tier they came from; "computed" = miss
    fallback: str | None = None  # why a blend ran as full prefill
    queue_ms: float = 0.0  # time waiting for a slot on the model thread (set by the server)
    conversation_tokens: int = 0  # earlier turns in the prompt
    conversation_cached_tokens: int = 0  # of those, read from the store
    dropped_messages: int = 0  # earlier messages left out: the conversation did not fit the context
    load_wait_ms: float = 0.0  # prefill time spent waiting for chunk KV layers (loading not hidden by compute)
    loading: dict | None = None  # blend.ratio auto: the controller's ratio, chunks recomputed from text, and why


@dataclass(frozen=True)
class KeyUse:
    """A store key the request's prompt read or wrote: its tokens and the chat message it belongs to (None for
    the head and passages; a conversation piece, one exchange today: the index in `QueryParams.turns` of its
    last turn). `cached`: read from the store, not computed for this request."""

    key: str
    tokens: int
    message: int | None
    cached: bool = False


@dataclass
class QueryResult:
    answer: str
    sources: list[Source]
    stats: QueryStats
    finish_reason: str
    explain: Explain | None = None
    kv_keys: list[KeyUse] = field(default_factory=list)  # in prompt order, the head first (full mode: none)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Piece:
    """One cached piece of the prompt: its tokens, the tokens it is computed after, its KV once known."""

    kind: Literal["head", "conversation", "passage"]
    ids: list[int]
    context_ids: list[int]
    kv: ChunkKV | LayerSource | None = None  # a passage's stored KV may be opened layer by layer
    tier: str | None = None  # where the KV came from; None until read, "computed" if computed here
    message: int | None = None  # a conversation piece: its last turn's index in QueryParams.turns


@dataclass
class _Plan:
    hits: list[Hit]
    pieces: list[_Piece]
    suffix: list[int]
    turns: tuple[tuple[str, str], ...]  # the turns kept in the prompt
    dropped: int


class RagEngine:
    def __init__(self, settings: Settings, components: Components | None = None):
        self.settings = settings
        self.parts = components or Components(settings)

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
        """Text deltas, then the QueryResult: one request run alone, on this thread (the driver, one slot)."""
        return Driver(self.parts.runtime.step).run(self.program(params, cancelled))

    def program(self, params: QueryParams, cancelled: Callable[[], bool] = lambda: False
                ) -> Generator[Any, Any, None]:
        """One request for the scheduler (see the module docstring for what it yields)."""
        parts, start = self.parts, time.perf_counter()
        stats = QueryStats(mode=params.mode)
        max_tokens = params.max_tokens or self.settings.limits.default_max_new_tokens

        # 1. Off the model thread: retrieve, lay the prompt out as token pieces, read their KV from the store.
        plan: _Plan = yield Offload(lambda: self._plan(params, max_tokens, stats))

        # 2. On it: compute the pieces the store lacked, one slice each. (Look again first: the previous
        #    turn stores its exchange on this thread after answering, perhaps after our look.)
        t = time.perf_counter()
        if params.mode != "full":
            for i, piece in enumerate(plan.pieces):
                if piece.kv is None:
                    piece.kv, piece.tier = parts.kv_cache.lookup(piece.ids, piece.context_ids)
                if piece.kv is None:
                    before = [p.kv for p in plan.pieces[:i]] if piece.kind == "conversation" else []
                    piece.kv, piece.tier = parts.kv_cache.compute(piece.ids, piece.context_ids, before), "computed"
                    yield
        stats.kv_load_ms += _ms(t)

        # 3. Prefill, a layer per slice.
        t = time.perf_counter()
        if params.mode == "full":
            prompt_ids = [i for p in plan.pieces for i in p.ids] + plan.suffix
            prefill = yield from parts.blender.prefill_steps([], prompt_ids, 1.0)
        else:
            ratio = 0.0 if params.mode == "reuse" else params.ratio
            if ratio is None and self.settings.blend.ratio == "auto":
                ratio, stats.loading = yield from parts.loading.ratio(plan.pieces, len(plan.suffix), params.selection,
                                                                      self._recompute)
            elif ratio is None:
                ratio = self.settings.blend.ratio
            prefill = yield from parts.blender.prefill_steps(
                [p.kv for p in plan.pieces], plan.suffix, ratio, selection=params.selection,
                pipeline=self.settings.blend.pipeline, recompute=lambda i: self._recompute(plan.pieces[i]))
            stats.selection = params.selection or parts.blender.selection
            passages = [p for p in plan.pieces if p.kind == "passage"]
            stats.store_hits = dict(Counter(p.tier for p in passages))
            for piece in passages:  # where each retrieved chunk's KV came from (app.usage)
                parts.kv_cache.served(piece.ids, piece.tier)
        stats.prefill_ms = _ms(t)
        _fill_prefill_stats(stats, prefill, params.mode, plan)
        if params.mode == "blend" and prefill.stats.fallback is None:  # live compute cost, for the controller
            tokens = (prefill.stats.recomputed_tokens + len(plan.suffix)) * parts.blender.num_layers
            parts.loading.observe(tokens, (stats.prefill_ms - stats.load_wait_ms) / 1000)

        # 4. Decode in a KV pool slot: one token per DecodeStep, batched by the driver with the other
        #    requests' (blend.decode.decode_loop, the loop every answer runs). Closing the program
        #    (done, cancelled, failed) gives the slot back.
        sampling = SamplingParams(max_new_tokens=max_tokens, temperature=params.temperature, top_p=params.top_p,
                                  stop=params.stop, seed=params.seed)
        eos = frozenset() if params.ignore_eos else parts.runtime.eos_ids
        text = TextStream(parts.tokenizer, stop=params.stop, eos_ids=eos)
        sequence = parts.runtime.start(prefill, sampling)  # the first token is chosen here
        stats.ttft_ms = _ms(start)
        try:
            yield from decode_loop(sequence, text, cancelled)
        finally:
            sequence.release()
        stats.completion_tokens = len(text.tokens)
        stats.total_ms = _ms(start)
        answer, finish = text.text.strip(), text.finish_reason or "length"
        sources = [Source(h.chunk.doc_id, h.chunk.id, h.title, round(float(h.score), 4), h.chunk.text)
                   for h in plan.hits]
        explain = None
        if params.explain_tokens:  # built after the answer: it never delays the first token
            explain = self._explain(plan, prefill, params.explain_tokens)
        yield QueryResult(answer, sources, stats, finish, explain, self._key_uses(plan, params.mode))

        # 5. After the answer is out: this exchange's KV, for the next turn (a few dozen tokens).
        if params.remember and params.mode != "full" and finish != "cancelled":
            self._remember(params, plan, answer)

    # ---- the plan, off the model thread ------------------------------------------------------------

    def _plan(self, params: QueryParams, max_tokens: int, stats: QueryStats) -> _Plan:
        parts, t = self.parts, time.perf_counter()
        hits = parts.retriever.search(params.retrieval_query or params.question,
                                      params.top_k or self.settings.retrieval.top_k) if params.retrieve else []
        head = parts.prompt.head_ids_for(params.system)
        passages = [parts.kv_cache.passage_ids(h.chunk.token_ids, h.title) for h in hits]
        suffix = parts.prompt.suffix_ids(params.question)
        stats.retrieve_ms = _ms(t)
        fixed = len(head) + sum(map(len, passages)) + len(suffix) + max_tokens
        self._check_length(fixed - max_tokens, max_tokens)
        turns, conversation = fit_conversation(parts.prompt, params.turns, params.system, fixed, self._context_limit())
        prompt_tokens, budget = fixed - max_tokens + sum(map(len, conversation)), self.settings.limits.max_prompt_tokens
        if prompt_tokens > budget:  # the route checked the messages; the passages are known only now
            raise RequestError(f"prompt of {prompt_tokens} tokens (messages, passages and question) exceeds "
                               f"limits.max_prompt_tokens ({budget}); lower top_k or shorten the messages")

        t = time.perf_counter()
        pieces, before = [_Piece("head", head, [])], list(head)
        for ids, message in zip(conversation, _last_turns(turns, len(conversation), len(params.turns) - len(turns))):
            pieces.append(_Piece("conversation", ids, before, message=message))
            before = before + ids
        pieces += [_Piece("passage", ids, parts.kv_cache.context_ids) for ids in passages]
        if params.mode != "full":
            for piece in pieces:  # passages opened layer-wise when pipelined (the prefill reads and closes them)
                read = parts.kv_cache.open if piece.kind == "passage" and self.settings.blend.pipeline \
                    else parts.kv_cache.lookup
                piece.kv, piece.tier = read(piece.ids, piece.context_ids)
        stats.kv_load_ms = _ms(t)
        return _Plan(hits, pieces, suffix, turns, len(params.turns) - len(turns))

    def _key_uses(self, plan: _Plan, mode: str) -> list[KeyUse]:
        """Every store key the prompt read or wrote (a full prefill reads and writes none)."""
        if mode == "full":
            return []
        key = self.parts.kv_cache.piece_key
        return [KeyUse(key(p.ids, p.context_ids), len(p.ids), p.message, p.tier != "computed") for p in plan.pieces]

    def _recompute(self, piece: _Piece) -> ChunkKV:
        """A piece whose stored KV failed to load mid-prefill (damaged, gone): computed (and stored) afresh."""
        piece.tier = "computed"
        return self.parts.kv_cache.compute(piece.ids, piece.context_ids)

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

    # ---- after the answer: the next turn's conversation KV -----------------------------------------

    def _explain(self, plan: _Plan, prefill: Prefill, max_tokens: int) -> Explain:
        head = [i for p in plan.pieces if p.kind != "passage" for i in p.ids]  # the head and any conversation
        passages = [p.ids for p in plan.pieces if p.kind == "passage"]
        return explain_prompt(self.parts.tokenizer, head, passages, plan.suffix, prefill,
                              score=self._score_meaning(prefill), max_tokens=max_tokens)

    def _score_meaning(self, prefill: Prefill) -> str:
        """What the scores of the policy that ran measure (its docstring), for the page's legend."""
        b = self.settings.blend
        policy = get_policy(prefill.stats.selection or b.selection)
        detail = f" (the {b.deviation}s at layer {b.check_layer})" if policy.deviation else ""
        return f"{policy.name}: {policy.doc}{detail}"

    def _remember(self, params: QueryParams, plan: _Plan, answer: str) -> None:
        """Store the KV of the exchange just answered, laid out as the next turn will lay it out: after
        the head and this turn's conversation, whose KV is at hand. Runs on the model thread."""
        turns = plan.turns + (("user", params.question), ("assistant", answer))
        pieces = self.parts.prompt.conversation_ids(turns, params.system)
        known = [p for p in plan.pieces if p.kind in ("head", "conversation")]
        if [p.ids for p in known[1:]] != pieces[:-1]:
            return  # the template re-rendered earlier turns differently (a transcript): nothing to extend
        context_ids = [i for p in known for i in p.ids]
        if self.parts.kv_cache.lookup(pieces[-1], context_ids)[0] is None:
            self.parts.kv_cache.compute(pieces[-1], context_ids, [p.kv for p in known])


def _last_turns(turns: tuple[tuple[str, str], ...], pieces: int, dropped: int) -> list[int]:
    """Each conversation piece's last turn, as an index into the request's turns (`dropped` left out before
    `turns`): a piece per exchange, ending at each assistant reply and at the end; one transcript piece
    when the template does not extend (blend.PromptFormat.conversation_ids)."""
    ends = [i for i, (role, _) in enumerate(turns) if role == "assistant"]
    ends += [len(turns) - 1] if turns and (not ends or ends[-1] != len(turns) - 1) else []
    return [dropped + end for end in (ends if len(ends) == pieces else [len(turns) - 1] * pieces)]


def _fill_prefill_stats(stats: QueryStats, prefill: Prefill, mode: str, plan: _Plan) -> None:
    s = prefill.stats
    stats.prompt_tokens = s.prompt_tokens
    stats.recomputed_tokens = s.recomputed_tokens
    stats.recompute_ratio = 1.0 if mode == "full" else s.ratio
    stats.fallback = s.fallback
    stats.load_wait_ms = s.load_wait_ms
    conversation = [p for p in plan.pieces if p.kind == "conversation"]
    stats.conversation_tokens = sum(len(p.ids) for p in conversation)
    stats.dropped_messages = plan.dropped
    if mode != "full" and s.fallback is None:  # only KV read from the store counts as cached
        stored = [p for p in plan.pieces if p.tier != "computed"]
        stats.cached_tokens = sum(len(p.ids) for p in stored)
        stats.conversation_cached_tokens = sum(len(p.ids) for p in stored if p.kind == "conversation")


def _ms(since: float) -> float:
    return round((time.perf_counter() - since) * 1000, 2)
