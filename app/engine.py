"""RagEngine: question → retrieve top-k → chunk KV (store or precompute) → blended prefill → decode.

The engine owns the model, which is not thread-safe. `program(params)` is one request as a generator
that blend.driver's Driver steps on the model thread (the server's scheduler, app.scheduler, several at a
time): it yields text deltas and finally a QueryResult for the client, and directives in between —
retrieval and store reads offloaded to another thread, one slice per prefill layer or precomputed piece,
one DecodeStep per token (batched with the other requests'). `stream()` runs one program alone through the
same driver, in one slot (the CLI, tests), and `answer()` collects it.

The prompt of a query: head | passages | question (blend.prompt). Of a chat, every message is a piece:
    head (system turn) | message | message | ... | [user turn opening | passages | question]
the bracket only with retrieval (then the last user message is the question, after its passages), else the
assistant turn's opening alone. Each message piece has two store entries, both keyed by content alone
(model, the tokens it was computed after, its tokens), so nothing of one request's context reaches another's:
    exact      computed in place, after exactly the tokens before it: where it reappears after the same
               tokens it is an exact prefix, used as is
    blendable  computed after the prompt head only, as passages are: anywhere else it is RoPE-shifted and
               blended (the request's selection policy and ratio)
A message never seen is computed in place (exact) while everything before it is exact; new messages at the
end of the prompt are computed with the question, in the prefill. After the answer is sent the program
stores what the next request may need: every message as this prompt had it, under the tokens before it (the
same prefix again is an exact prefix: the KV this answer was computed from), the blendable form of every
message that lacks one, and (chat) the exchange just answered, in place, so the next turn is an exact prefix.
When the messages do not fit the context, the oldest are dropped first; with blend.ratio auto the loading
controller (app.loading) picks the ratio.
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Any, Callable, Generator, Iterator

from app.components import Components
from app.config import Settings
from app.explain import Explain, explain_prompt
from app.prompt_plan import (SYSTEM_ROLES, ChatLayout, Piece, Plan, compute_a_short_blend_with_the_end,
                             fill_prefill_stats, message_text, span_kv, stored_as_prompted, within_chars)
from app.query import KeyUse, QueryParams, QueryResult, QueryStats, RequestError, Source
from app.tool_calls import split_tool_calls
from app.usage import COMPUTED
from blend import ChunkKV, Prefill, SamplingParams, TextStream
from blend.controller import Calibration
from blend.decode import decode_loop
from blend.driver import Driver, Offload
from blend.grammar import GrammarError
from blend.pipeline import LayerSource
from blend.prompt import ChatTemplateError
from blend.selection import get_policy


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
        try:  # the answer's grammar (tool_choice, response_format: app.tool_calls), compiled once per grammar
            constraint = parts.runtime.grammars.constraint(params.grammar) if params.grammar else None
        except GrammarError as exc:
            raise RequestError(f"the schema does not compile: {exc}") from None
        plan, prefill = yield from self.prefill(params, max_tokens, stats)

        # 4. Decode in a KV pool slot: one token per DecodeStep, batched by the driver with the other
        #    requests' (blend.decode.decode_loop, the loop every answer runs). Closing the program
        #    (done, cancelled, failed) gives the slot back.
        sampling = SamplingParams(max_new_tokens=max_tokens, temperature=params.temperature, top_p=params.top_p,
                                  stop=params.stop, seed=params.seed)
        eos = frozenset() if params.ignore_eos else parts.runtime.eos_ids
        text = TextStream(parts.tokenizer, stop=params.stop, eos_ids=eos)
        sequence = parts.runtime.start(prefill, sampling, constraint)  # the first token is chosen here
        stats.ttft_ms = _ms(start)
        try:
            yield from decode_loop(sequence, text, cancelled)
        finally:
            sequence.release()
        stats.completion_tokens = len(text.tokens)
        stats.total_ms = _ms(start)
        answer, finish = text.text.strip(), text.finish_reason or "length"
        content, calls = split_tool_calls(answer) if params.tool_calls else (answer, [])
        sources = [Source(h.chunk.doc_id, h.chunk.id, h.title, round(float(h.score), 4), h.chunk.text)
                   for h in plan.hits]
        explain = None
        if params.explain_tokens:  # built after the answer: it never delays the first token
            explain = self._explain(plan, prefill, params.explain_tokens)
        if params.mode != "full" and finish != "cancelled":  # no compute: every key in kv_keys is stored
            self.store_as_prompted(plan, prefill)
        yield QueryResult(content, sources, stats, finish, explain, self._key_uses(plan, params.mode), calls,
                          text.stop_sequence)

        # 5. After the answer is out: what the next request may need (module docstring).
        if params.mode != "full" and finish != "cancelled":
            yield from self.store_after(plan, prefill, answer if params.remember else None)

    def prefill(self, params: QueryParams, max_tokens: int, stats: QueryStats
                ) -> Generator[Any, Any, tuple[Plan, Prefill]]:
        """Steps 1-3 of a request: its plan and its prefill (the benchmarks score the prefill)."""
        parts = self.parts
        # 1. Off the model thread: retrieve, lay the prompt out as token pieces, read their KV from the store.
        plan: Plan = yield Offload(lambda: self._plan(params, max_tokens, stats))

        # 2. On it: compute the pieces the store lacked, one slice each. (Look again first: the previous
        #    turn stores its exchange on this thread after answering, perhaps after our look.)
        t = time.perf_counter()
        if params.mode != "full":
            for i, piece in enumerate(plan.pieces):
                if piece.kv is None and piece.source != "fresh":
                    piece.kv, piece.tier = parts.kv_cache.lookup(piece.ids, piece.entry_context)
                if piece.kv is None and piece.source != "fresh":
                    before = [p.kv for p in plan.pieces[:i]] if piece.in_place else []
                    piece.kv = parts.kv_cache.compute(piece.ids, piece.entry_context, before)
                    piece.tier = COMPUTED
                    yield
        stats.kv_load_ms += _ms(t)

        # 3. Prefill, a layer per slice.
        t = time.perf_counter()
        if params.mode == "full":
            prompt_ids = [i for p in plan.pieces for i in p.ids] + plan.suffix
            prefill = yield from parts.blender.prefill_steps([], prompt_ids, 1.0)
        else:
            ratio = 0.0 if params.mode in ("reuse", "prefix") else params.ratio
            segments = plan.segments
            if ratio is None and self.settings.blend.ratio == "auto":
                ratio, stats.loading = yield from parts.loading.ratio(segments, len(plan.prefill_suffix),
                                                                      params.selection, self._recompute)
            elif ratio is None:
                ratio = self.settings.blend.ratio
            prefill = yield from parts.blender.prefill_steps(
                [p.kv for p in segments], plan.prefill_suffix, ratio, selection=params.selection,
                pipeline=self.settings.blend.pipeline, recompute=lambda i: self._recompute(segments[i]))
            stats.selection = params.selection or parts.blender.selection
            passages = [p for p in plan.pieces if p.kind == "passage"]
            stats.store_hits = dict(Counter(p.tier for p in passages))
            for piece in passages:  # where each retrieved chunk's KV came from (app.usage)
                parts.kv_cache.served(piece.ids, piece.tier)
        stats.prefill_ms = _ms(t)
        fill_prefill_stats(stats, prefill, params.mode, plan)
        if params.mode == "blend" and prefill.stats.fallback is None:  # live compute cost, for the controller
            tokens = (prefill.stats.recomputed_tokens + len(plan.prefill_suffix)) * parts.blender.num_layers
            parts.loading.observe(tokens, (stats.prefill_ms - stats.load_wait_ms) / 1000)
        return plan, prefill

    # ---- the plan, off the model thread ------------------------------------------------------------

    def lookup(self, params: QueryParams) -> Plan:
        """The request's plan as its program would make it, each piece's `tier` and `source` saying where its KV
        is (nothing read, nothing computed): POST /v1/cache/lookup."""
        max_tokens = params.max_tokens or self.settings.limits.default_max_new_tokens
        return self._plan(params, max_tokens, QueryStats(mode=params.mode), read=False)

    def _plan(self, params: QueryParams, max_tokens: int, stats: QueryStats, read: bool = True) -> Plan:
        parts, t = self.parts, time.perf_counter()
        hits = parts.retriever.search(params.retrieval_query or params.question,
                                      params.top_k or self.settings.retrieval.top_k) if params.retrieve else []
        passages = [parts.kv_cache.passage_ids(h.chunk.token_ids, h.title) for h in hits]
        stats.retrieve_ms = _ms(t)
        if params.messages:
            try:
                pieces, suffix, chat, dropped = self._chat_pieces(params, passages, max_tokens)
            except ChatTemplateError as exc:
                raise RequestError(str(exc)) from exc
        else:
            head = parts.prompt.head_ids
            pieces, suffix, chat, dropped = [Piece("head", head, [])], parts.prompt.suffix_ids(params.question), \
                None, 0
        pieces += [Piece("passage", ids, parts.kv_cache.context_ids) for ids in passages]
        prompt_tokens = sum(len(p.ids) for p in pieces) + len(suffix)
        self._check_length(prompt_tokens, max_tokens)
        budget = self.settings.limits.max_prompt_tokens
        if prompt_tokens > budget:  # the route checked the messages; the passages are known only now
            raise RequestError(f"prompt of {prompt_tokens} tokens (messages, passages and question) exceeds "
                               f"limits.max_prompt_tokens ({budget}); lower top_k or shorten the messages")

        t = time.perf_counter()
        plan = Plan(hits, pieces, suffix, dropped, chat, blends=params.mode != "prefix")
        if params.mode != "full":
            self._find_kv(plan, read, prefix_only=params.mode == "prefix")
        stats.kv_load_ms = _ms(t)
        return plan

    def _chat_pieces(self, params: QueryParams, passages: list[list[int]], max_tokens: int
                     ) -> tuple[list[Piece], list[int], ChatLayout, int]:
        """A chat's head and message pieces (the newest messages that fit the context), its suffix."""
        prompt, template = self.parts.prompt, self.parts.prompt.chat
        system = "\n\n".join(message_text(m) for m in params.messages
                             if m["role"] in SYSTEM_ROLES and message_text(m)) or None
        indexed = [(i, m) for i, m in enumerate(params.messages) if m["role"] not in SYSTEM_ROLES]
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
        layout = template.layout([m for _, m in indexed[start:]], params.tools, system)
        suffix = prompt.suffix_ids(message_text(question), system) if question else layout.tail
        fixed = len(opening) + sum(map(len, passages)) + len(suffix) + max_tokens
        while limit and len(layout.head) + sum(map(len, layout.messages)) + fixed > limit \
                and start < len(indexed) - keep:  # drop the oldest messages, as many as the excess
            excess, drop = len(layout.head) + sum(map(len, layout.messages)) + fixed - limit, 0
            while excess > 0 and drop < min(len(layout.messages), len(indexed) - keep - start):
                excess, drop = excess - len(layout.messages[drop]), drop + 1
            start += max(drop, 1)
            layout = template.layout([m for _, m in indexed[start:]], params.tools, system)
        kept = indexed[start:]
        blend_context = self.parts.kv_cache.context_ids
        pieces, before = [Piece("head", layout.head, [])], list(layout.head)
        numbers = [i for i, _ in kept] if layout.split else [kept[-1][0]] * len(layout.messages)
        for ids, number in zip(layout.messages, numbers):
            pieces.append(Piece("message", ids, before, message=number, blend_context=blend_context))
            before = before + ids
        if opening:
            pieces.append(Piece("opening", opening, before, blend_context=blend_context))
        chat = ChatLayout(system, [m for _, m in kept], params.tools, question)
        return pieces, suffix, chat, start

    def _find_kv(self, plan: Plan, read: bool, prefix_only: bool = False) -> None:
        """Each piece's KV (`read`: else only the tier that holds it) and how it is had: an exact entry while
        everything before it is exact, else its blendable form; a piece with neither is computed in place
        while the prefix is exact, else its blendable form is; new pieces at the end run with the question.
        `prefix_only` (mode prefix, what prefix caching does): everything after the exact prefix runs with the
        question."""
        exact, before, pipeline = True, [], self.settings.blend.pipeline
        for piece in plan.pieces:
            exact = exact and (piece.kind != "passage" or piece.context_ids == before)
            before = before + piece.ids if exact else before
            if prefix_only and not exact:
                piece.source, piece.tier = "fresh", COMPUTED
                continue
            if piece.kind == "passage":  # opened layer-wise when pipelined (the prefill reads and closes it)
                piece.kv, piece.tier = self._read(piece.ids, piece.context_ids, read, open_=pipeline)
                exact = exact and piece.tier is not None
                continue
            if exact:
                piece.kv, piece.tier = self._read(piece.ids, piece.context_ids, read)
                if piece.tier is not None:
                    piece.source = "exact"
                    continue
            if piece.blend_context is not None and not prefix_only and not (exact and piece.kind == "opening"):
                # (the passages' few-token opening is computed in place where it can be: the passages after
                # it then stay an exact prefix)
                piece.kv, piece.tier = self._read(piece.ids, piece.blend_context, read)
                if piece.tier is not None:
                    piece.source, piece.entry_context, exact = "blended", piece.blend_context, False
                    continue
            piece.source = "computed"  # in place while the prefix is exact, else its blendable form
            if not exact:
                piece.entry_context = piece.blend_context
        # New pieces at the very end (no passage after them) are computed with the question, in the prefill;
        # so is the last message when nothing else would be (a template whose chat ends without an opening).
        for piece in reversed(plan.pieces):
            if piece.kind not in ("message", "opening") or piece.source != "computed":
                break
            piece.source, piece.entry_context = "fresh", piece.context_ids  # computed here, stored as prompted
        if not plan.prefill_suffix and plan.pieces[-1].kind == "message":
            last = plan.pieces[-1]
            last.source, last.entry_context = "fresh", last.context_ids
        compute_a_short_blend_with_the_end(plan.pieces)

    def _read(self, ids: list[int], context_ids: list[int], read: bool, open_: bool = False
              ) -> tuple[ChunkKV | LayerSource | None, str | None]:
        cache = self.parts.kv_cache
        if not read:
            return None, cache.tier_of(ids, context_ids)
        return (cache.open if open_ else cache.lookup)(ids, context_ids)

    def _recompute(self, piece: Piece) -> ChunkKV:
        """A piece whose stored KV failed to load mid-prefill (damaged, gone): computed (and stored) afresh."""
        piece.tier = COMPUTED
        return self.parts.kv_cache.compute(piece.ids, piece.entry_context)

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

    def _key_uses(self, plan: Plan, mode: str) -> list[KeyUse]:
        """Every store key the prompt read or wrote (a full prefill reads and writes none)."""
        if mode == "full":
            return []
        key = self.parts.kv_cache.piece_key
        return [KeyUse(key(p.ids, p.entry_context), len(p.ids), p.message,
                       p.tier not in (COMPUTED, None) and p.source != "fresh") for p in plan.pieces]

    # ---- after the answer ----------------------------------------------------------------------------

    def _explain(self, plan: Plan, prefill: Prefill, max_tokens: int) -> Explain:
        head = [i for p in plan.segments if p.kind != "passage" for i in p.ids]  # the head and any messages
        passages = [p.ids for p in plan.pieces if p.kind == "passage"]
        return explain_prompt(self.parts.tokenizer, head, passages, plan.prefill_suffix, prefill,
                              score=self._score_meaning(prefill), max_tokens=max_tokens)

    def _score_meaning(self, prefill: Prefill) -> str:
        """What the scores of the policy that ran measure (its docstring), for the page's legend."""
        b = self.settings.blend
        policy = get_policy(prefill.stats.selection or b.selection)
        detail = f" (the {b.deviation}s at layer {b.check_layer})" if policy.deviation else ""
        return f"{policy.name}: {policy.doc}{detail}"

    def store_after(self, plan: Plan, prefill: Prefill, answer: str | None) -> Generator[None, None, None]:
        """Step 5, on the model thread after the answer (and `store_as_prompted`), a slice each: with `answer` (a
        chat that remembers) the exchange just answered, computed in place after the prompt's messages, for the
        next turn; then every message's blendable form it lacks (not in mode prefix, which never blends)."""
        cache = self.parts.kv_cache
        known = [p for p in plan.pieces if p.kind in ("head", "message")]
        if answer is not None and plan.chat is not None:
            yield from self._remember(plan, known, answer)  # first: the next turn may be on its way
        for piece in plan.pieces if plan.blends else ():
            if piece.blend_context is not None and piece.source != "blended" \
                    and cache.tier_of(piece.ids, piece.blend_context) is None:
                cache.compute(piece.ids, piece.blend_context)
                yield

    def store_as_prompted(self, plan: Plan, prefill: Prefill) -> None:
        """Every message piece not read exact here stored as this prompt had it (cut from the prefill's cache,
        no compute) under the tokens before it: the same prefix again is an exact prefix. Before the result, so
        every key the result names is in the store."""
        cache, before = self.parts.kv_cache, []
        for piece in plan.segments + plan.fresh:  # the prompt's order (fresh pieces ran last)
            if stored_as_prompted(piece):
                piece.kv = cache.put(piece.ids, before, span_kv(prefill, before, piece.ids, cache.blender.fingerprint))
                piece.entry_context = before  # kv_keys names this entry: the one the same prompt reads next
            before = before + piece.ids

    def _remember(self, plan: Plan, known: list[Piece], answer: str) -> Generator[None, None, None]:
        """The exchange just answered, laid out as the next turn will lay it out and computed in place after
        this prompt's messages (whose exact KV is at hand): the next turn finds its whole chat an exact prefix."""
        chat, cache = plan.chat, self.parts.kv_cache
        new = [chat.question] * (chat.question is not None) + [{"role": "assistant", "content": answer}]
        layout = self.parts.prompt.chat.layout(chat.kept + new, chat.tools, chat.system)
        if not layout.split or [layout.head, *layout.messages[:len(known) - 1]] != [p.ids for p in known]:
            return  # the template renders the earlier messages otherwise now: nothing to extend
        before = [p.kv for p in known]
        context_ids = [i for p in known for i in p.ids]
        for ids in layout.messages[len(known) - 1:]:
            kv = cache.lookup(ids, context_ids)[0]
            if kv is None:
                kv = cache.compute(ids, context_ids, before)
                yield
            before, context_ids = before + [kv], context_ids + ids


def _ms(since: float) -> float:
    return round((time.perf_counter() - since) * 1000, 2)
