"""Blender: CacheBlend selective recompute through the model's own HF decoder layers.

Contract:
    precompute(ids, context_ids) -> ChunkKV        a chunk's K/V, computed after `context_ids`
    prefill(segments, suffix_ids, ratio) -> Prefill
        segments: cached ChunkKVs laid out in order, or LayerSources (a store entry read a layer at a
        time; with pipeline=True a loader thread reads layer i+1 while layer i computes: blend.pipeline),
        or `fresh(ids, position)` spans with no KV, computed in the prefill through every layer;
        the suffix is always computed fresh.
        ratio 1 reproduces full prefill, ratio 0 is full reuse (shifted KV concatenated); the ratio is of the
        cached tokens (fresh ones always run).
    prefill_steps(...) -> Generator[int, None, Prefill]
        the same prefill, resumable: it yields after each slice of work - a layer over at most
        `chunk_tokens` of its tokens (chunked prefill, as vLLM's) - the token-layers it ran (tokens x layers),
        so a scheduler can run other requests between the slices of a long prefill (blend.driver)
    full_prefill(ids) -> Prefill                   the model's own forward over every token (the reference)
    teacher_force(prefill, target_ids) -> logits   the model's own forward over an answer (scoring)
Decoding from a Prefill is blend.runtime.DecodeRuntime's (its KV pool, its step, its graphs).

The blended prefill, step by step:
    1. lay the segments and suffix out at absolute positions; RoPE-shift each segment's keys
    2. leading segments computed after exactly the tokens before them are exact (prefix cache);
       the other cached tokens are the candidates
    3. a selection policy (blend.selection) scores the candidates with what it asks for: the
       question's attention from a question-only pass over the cached keys, and/or the K/V
       deviation (fresh vs cached) at the check layer after running every candidate through
       layers 0..check_layer
    4. keep the top `ratio` of candidates plus the suffix; the remaining layers run only those,
       writing fresh K/V over the cached ones, queries attending to all keys causally
       (blend.attention plans that attention so only the visible keys are computed)
Each layer runs its tokens in chunks of at most `chunk_tokens` rows, a slice each (None: a layer is one slice).
That is exact: the rows are sorted by position and a chunk's queries see only keys at or before theirs, which
are cached or were written by this layer's earlier chunks; the check layer's deviations and the question's
attention are gathered over the chunks.

Models the loop cannot run exactly (blend.gate, plus a probe prompt at start-up) and prompts longer
than a sliding window run full prefill instead; `unsupported` / `PrefillStats.fallback` say why.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Generator, Literal, Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from blend.attention import BLEND_ATTENTION
from blend.backend import Backend, backend_for
from blend.cache import BlendCache, StoredSpans
from blend.driver import drain
from blend.gate import judge, sliding_window, static_refusal, tolerance
from blend.pipeline import ChunkMiss, Fresh, LayerLoader, LayerSource, as_source
from blend.rope import RopeShifter, RopeUnsupportedError
from blend.selection import Policy, SelectionContext, get_policy, select
from common.chunk_kv import ChunkKV, KVMismatchError, hash_ids

log = logging.getLogger("ragblend.blend")
# The start-up probe's length: past a 128-key block (FlexAttention's) with chunk boundaries inside, still quick.
PROBE_TOKENS = 136

@dataclass
class PrefillStats:
    prompt_tokens: int
    cached_tokens: int = 0       # tokens whose K/V came from segments
    exact_tokens: int = 0        # of those, the exact prefix (never recomputed)
    recomputed_tokens: int = 0   # cached tokens recomputed after the check layer
    ratio: float = 1.0
    selection: str | None = None  # the policy that chose the recomputed tokens
    fallback: str | None = None  # why a blend ran as full prefill
    timings_ms: dict[str, float] = field(default_factory=dict)
    pipelined: bool = False      # chunk layers loaded by a thread while earlier layers computed
    load_wait_ms: float = 0.0    # time the layers waited for their cached K/V (not hidden by compute)
    reloaded_chunks: int = 0     # chunks whose KV failed to load mid-prefill: recomputed, prefill redone


@dataclass
class Prefill:
    """The prompt's cache and next-token logits, and what the selection did (for stats and "explain").

    selected: absolute positions [k] (sorted) of the cached tokens recomputed through every layer.
    scores:   float [prompt tokens]: the selection policy's score of each candidate (a cached token
              after the exact prefix); NaN where nothing was scored (the exact prefix, the suffix,
              and every position when the ratio is 0 or 1, where no choice is made). Higher = more
              in need of recompute; scales differ between policies.
    """
    cache: BlendCache
    logits: torch.Tensor           # [V] next-token logits after the prompt
    num_tokens: int
    selected: torch.Tensor
    stats: PrefillStats
    scores: torch.Tensor


class _Clock:
    """Phase laps. Each lap waits for the device's queued work first (Backend.synchronize: on a GPU, a few
    waits per prefill, at phase ends; nothing on the CPU), so a phase's time is its own work, not what was
    queued before it."""

    def __init__(self, backend: Backend) -> None:
        self.timings: dict[str, float] = {}
        self.backend = backend
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        self.backend.synchronize()
        now = time.perf_counter()
        self.timings[name] = round((now - self._last) * 1000, 3)
        self._last = now


class _QuestionAttention:
    """Attention probe: records the suffix queries' softmax attention over the candidates, per layer
    and head, averaged over the suffix tokens (so a long question costs no more memory). The question pass
    runs the suffix alone, a chunk of its rows per call, in order: the probe sums each layer's chunks."""

    def __init__(self, ctx: SelectionContext, suffix_len: int, total: int, layers: range, device: torch.device):
        self.ctx, self.suffix_len, self.layers = ctx, suffix_len, layers
        query_pos = torch.arange(total - suffix_len, total, device=device)
        self.hidden_keys = torch.arange(total, device=device)[None, :] > query_pos[:, None]     # [Ts, N] causal
        self.rows_seen: dict[int, int] = {}       # layer -> suffix rows probed so far
        self.sums: dict[int, torch.Tensor] = {}   # layer -> [Hq, n] attention summed over those rows

    def __call__(self, module, query: torch.Tensor, key: torch.Tensor) -> None:
        # query: [1, Hq, Tq, D], the suffix's next Tq rows; key: [1, Hkv, N, D]
        layer = module.layer_idx
        if layer not in self.layers:
            return
        first = self.rows_seen.get(layer, 0)
        rows = slice(first, first + query.shape[2])
        self.rows_seen[layer] = rows.stop
        q = query[0]                                                               # [Hq, Tq, D]
        k = key[0].repeat_interleave(q.shape[0] // key.shape[1], dim=0)           # [Hq, N, D]
        logits = (q @ k.transpose(1, 2)) * module.scaling                          # [Hq, Tq, N]
        probs = logits.masked_fill(self.hidden_keys[rows], float("-inf")).softmax(-1)
        part = probs[..., self.ctx.exact:self.ctx.cached].float().sum(1)           # [Hq, n]
        self.sums[layer] = part if layer not in self.sums else self.sums[layer] + part
        # [Hq, n], left on the device: the selection reads it once, after the pass
        self.ctx.attention[layer] = self.sums[layer] / self.suffix_len


class Blender:
    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, fingerprint: str, *,
                 check_layer: int = 1, deviation: Literal["value", "key"] = "value", selection: str = "query",
                 cpu_kernel: str = "auto", chunk_tokens: int | None = None):
        self.model, self.tokenizer, self.fingerprint = model, tokenizer, fingerprint
        if chunk_tokens is not None and chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be at least 1 (or None: a layer's tokens in one piece), got "
                             f"{chunk_tokens}")
        self.chunk_tokens = chunk_tokens  # a prefill slice: one layer over at most this many tokens
        self.decoder = model.model
        config = model.config.get_text_config(decoder=True)
        self.num_layers = config.num_hidden_layers
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if not 0 <= check_layer <= self.num_layers - 2:
            raise ValueError(f"check_layer must be in [0, {self.num_layers - 2}] for this {self.num_layers}-layer "
                             f"model (the layers after it run the selected tokens), got {check_layer}")
        self.check_layer, self.deviation = check_layer, deviation
        self.selection = get_policy(selection).name
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device  # every tensor the blend path makes lives here
        self.backend = backend_for(self.device, cpu_kernel)  # the device's attention, staging, layer forms
        self.backend.prepare(model, self.head_dim)
        self.sliding_window = sliding_window(model)  # prompts longer than this run in full
        self.shifter: RopeShifter | None = None
        self.unsupported: str | None = None   # why this model never blends (None: it does); shown in /health
        self.unsupported = self._gate()       # (set after the probe, which runs prefill)
        if self.unsupported:
            log.warning("blending disabled, every prefill runs in full", extra={"reason": self.unsupported})

    def _gate(self) -> str | None:
        """Check the blend loop can run this model exactly; if not, leave the model its own attention."""
        own = self.model.config._attn_implementation
        reason = static_refusal(self.model)
        if reason is None:
            try:
                self.shifter = RopeShifter(self.model)
            except RopeUnsupportedError as exc:
                reason = str(exc)
        if reason is None:
            self.model.set_attn_implementation(BLEND_ATTENTION)
            try:
                reason = self._probe()
            except Exception as exc:  # noqa: BLE001 - e.g. an attention kernel that does not compile here
                reason = f"the probe prompt failed in the blend loop: {type(exc).__name__}: {exc}"
        if reason and self.model.config._attn_implementation == BLEND_ATTENTION:
            fallback = own if own != BLEND_ATTENTION else "sdpa" if self.model._supports_sdpa else "eager"
            self.model.set_attn_implementation(fallback)
        return reason

    def _probe(self) -> str | None:
        """A short prompt (an exact prefix, a moved chunk, a suffix) through the loop must match the model's
        own forward as closely as that forward matches itself split in two (blend.gate.judge): blend@1 (the
        layers, attention and head) and reuse of the moved chunk vs the same chunk computed in place (the
        RoPE shift: at ratio 1 every cached key is recomputed, so only reuse reads shifted keys)."""
        config = self.model.config.get_text_config(decoder=True)
        context = getattr(config, "max_position_embeddings", None) or PROBE_TOKENS
        n = min(PROBE_TOKENS, self.sliding_window or PROBE_TOKENS, context)  # within the window: it really blends
        ids = (torch.arange(n) * 7 % config.vocab_size).tolist()
        a, b = n // 3, 2 * n // 3
        own = self.full_prefill(ids).logits
        # The model's own rounding: its forward split in two at each boundary vs in one piece.
        spread = max(float((own - self._forward_in_two(ids, split)).abs().max()) for split in (a, b, (b + n) // 2))
        head, moved = self.precompute(ids[:a]), self.precompute(ids[a:b])   # `moved` computed at 0, placed at a
        checks = {"blend loop": (self.prefill([head, moved], ids[b:], 1.0).logits, own),
                  "RoPE shift": (self.prefill([head, moved], ids[b:], 0.0).logits,
                                 self.prefill([head, self._precompute_at(ids[a:b], a)], ids[b:], 0.0).logits)}
        for what, (got, reference) in checks.items():
            error, scale = float((got - reference).abs().max()), float(reference.abs().max())
            top1_equal = bool(got.argmax() == reference.argmax())
            if not judge(error, spread, top1_equal, self.dtype, scale):
                return (f"the {what} does not reproduce {type(self.model).__name__}'s own forward in {self.dtype} "
                        f"(max |logit difference| {error:.3g} on a probe prompt, over "
                        f"{tolerance(spread, self.dtype, scale):.3g} allowed: the model's own one-vs-two-pieces "
                        f"spread is {spread:.3g}; top-1 {'equal' if top1_equal else 'differs'})")
        return None

    @torch.inference_mode()
    def _forward_in_two(self, ids: list[int], split: int) -> torch.Tensor:
        """The model's own forward over `ids` in two pieces through a cache: last logits [V] (float32, host)."""
        cache = BlendCache(*self._empty_kv(0, reserve=len(ids)), length=0)
        self.model(input_ids=torch.tensor([ids[:split]], device=self.device), cache=cache, use_cache=True)
        out = self.model(input_ids=torch.tensor([ids[split:]], device=self.device), cache=cache, use_cache=True,
                         logits_to_keep=1)
        return out.logits[0, -1].float().cpu()

    @torch.inference_mode()
    def _precompute_at(self, ids: list[int], position: int) -> ChunkKV:
        """K/V of `ids` computed alone at positions position.. (no context): what a shift to there should give."""
        cache = BlendCache(*self._empty_kv(0, reserve=len(ids)), length=0)
        positions = torch.arange(position, position + len(ids), device=self.device)[None]
        self.decoder(input_ids=torch.tensor([ids], device=self.device), position_ids=positions, cache=cache,
                     use_cache=True)
        keys = torch.stack([layer.keys[0] for layer in cache.layers])              # [L, H, T, D]
        values = torch.stack([layer.values[0] for layer in cache.layers])
        return ChunkKV(keys, values, torch.tensor(ids), position, hash_ids([]), self.fingerprint)

    # ---- precompute -----------------------------------------------------------------------

    @torch.inference_mode()
    def precompute(self, ids: Sequence[int], context_ids: Sequence[int] = (),
                   context: ChunkKV | None = None) -> ChunkKV:
        """K/V of `ids` computed right after `context_ids` (pass `context`, their ChunkKV, to skip recomputing them)."""
        ids, context_ids = list(ids), list(context_ids)
        if context is not None and context.token_ids.tolist() != context_ids:
            raise KVMismatchError("context ChunkKV does not hold context_ids")
        start = len(context_ids)
        if context is not None and start:
            keys, values = self._empty_kv(start, reserve=len(ids))                # [L, H, start + T, D]
            keys[:, :, :start], values[:, :, :start] = context.keys, context.values
            cache, new_ids = BlendCache(keys, values, length=start), ids
        else:
            cache, new_ids = BlendCache(*self._empty_kv(0, reserve=start + len(ids)), length=0), context_ids + ids
        positions = torch.arange(len(context_ids) + len(ids), device=self.device)[None, -len(new_ids):]
        self.decoder(input_ids=torch.tensor([new_ids], device=self.device), position_ids=positions, cache=cache,
                     use_cache=True)
        keys = torch.stack([layer.keys[0, :, start:] for layer in cache.layers])   # [L, H, T, D]
        values = torch.stack([layer.values[0, :, start:] for layer in cache.layers])
        return ChunkKV(keys, values, torch.tensor(ids), start, hash_ids(context_ids), self.fingerprint)

    # ---- prefill --------------------------------------------------------------------------

    def fresh(self, ids: Sequence[int], position: int) -> Fresh:
        """A segment of `ids` at `position` with no KV: computed in the prefill (any ratio), with the suffix."""
        return Fresh(torch.tensor(list(ids), dtype=torch.int64), position, self.kv_heads, self.head_dim,
                     self.num_layers)

    @torch.inference_mode()
    def full_prefill(self, ids: Sequence[int], *, reserve: int = 0) -> Prefill:
        """Every token through the model's own forward (its own attention, masks and head), in one piece: the
        reference. `reserve` leaves room in the cache for that many decoded tokens."""
        return drain(self._full_steps(list(ids), reserve, [slice(0, len(ids))]))

    def _full_steps(self, ids: list[int], reserve: int, chunks: list[slice]) -> Generator[int, None, Prefill]:
        """The model's own forward over `ids`, a chunk of tokens at a time through the cache (each sees the ones
        before it, as in generation), yielding after each chunk."""
        clock = _Clock(self.backend)
        cache = BlendCache(*self._empty_kv(0, reserve=len(ids) + reserve), length=0)
        for rows in chunks:
            out = self.model(input_ids=torch.tensor([ids[rows]], device=self.device), cache=cache, use_cache=True,
                             logits_to_keep=1)
            yield (rows.stop - rows.start) * self.num_layers
        clock.lap("layers")
        stats = PrefillStats(len(ids), timings_ms=clock.timings)
        return Prefill(cache, out.logits[0, -1].float().cpu(), len(ids), torch.empty(0, dtype=torch.long), stats,
                       torch.full((len(ids),), float("nan")))

    def prefill(self, segments: Sequence[ChunkKV], suffix_ids: Sequence[int], ratio: float, **options) -> Prefill:
        """The whole prefill at once (see `prefill_steps` for the options)."""
        return drain(self.prefill_steps(segments, suffix_ids, ratio, **options))

    def prefill_steps(self, segments: Sequence[ChunkKV | LayerSource], suffix_ids: Sequence[int], ratio: float, *,
                      selection: str | Policy | None = None, seed: int = 0, reserve: int = 0,
                      pipeline: bool = False, recompute: Callable[[int], ChunkKV] | None = None,
                      stored: StoredSpans | None = None) -> Generator[int, None, Prefill]:
        """Blend `segments` + the suffix, yielding after each slice (a layer's chunk of tokens); returns the
        Prefill. `selection` names a policy in blend.selection (default: the Blender's); `reserve` leaves room in
        the cache for that many decoded tokens (the buffer would grow anyway, by a copy).

        Segments are ChunkKVs or LayerSources (blend.pipeline: a store entry read layer by layer); the
        prefill closes every LayerSource it is given. `pipeline`: a loader thread reads layer i+1 while
        layer i computes (same logits as loading every layer first). A segment that fails to load is a
        miss: `recompute(index)` gives its ChunkKV and the prefill starts again (without `recompute`,
        ChunkMiss is raised). `stored`: the spans the store will keep, attended to as their round trip (from the
        layer's chunk that reaches a span's end; the model's own forward, a refused model's, ignores it)."""
        sources = [as_source(s) for s in segments]  # a failed one is closed as it is replaced
        reloaded = 0
        try:
            while True:
                try:
                    result = yield from self._blend_steps(sources, suffix_ids, ratio, selection, seed, reserve,
                                                          pipeline, stored)
                    result.stats.reloaded_chunks = reloaded
                    return result
                except ChunkMiss as miss:
                    if recompute is None:
                        raise
                    log.warning("chunk KV failed to load, recomputing it", extra={"chunk": miss.index,
                                                                                  "reason": str(miss.cause)})
                    sources[miss.index].close()
                    sources[miss.index] = as_source(recompute(miss.index))
                    reloaded += 1
        finally:
            for source in sources:
                source.close()

    @torch.inference_mode()
    def _blend_steps(self, sources: list[LayerSource], suffix_ids: Sequence[int], ratio: float,
                     selection: str | Policy | None, seed: int, reserve: int, pipeline: bool,
                     stored: StoredSpans | None) -> Generator[int, None, Prefill]:
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"ratio must be in [0, 1], got {ratio}")
        if not suffix_ids:
            raise ValueError("the suffix must hold at least one token (the question)")
        policy = get_policy(selection or self.selection)
        clock = _Clock(self.backend)
        for seg in sources:
            self._check_segment(seg)
        ids = torch.cat([s.token_ids for s in sources] + [torch.tensor(list(suffix_ids), dtype=torch.int64)])
        ids = ids.to(self.device)
        reason = self.unsupported or self._window_refusal(ids.numel())
        if reason:  # the loop would not be exact: run the same tokens through the model's own forward
            log.debug("full prefill instead of blending", extra={"reason": reason})
            # a slice is a chunk of tokens through every layer (the model's forward is not cut by layer)
            result = yield from self._full_steps(ids.tolist(), reserve, self._chunks(ids.numel()))
            result.stats.fallback = reason
            return result

        # 1. Layout and cache: cached K/V rotated to their new positions, a layer at a time (blend.pipeline).
        total = ids.numel()
        bounds, start = [], 0
        for seg in sources:
            bounds.append((start, start + len(seg.token_ids)))
            start += len(seg.token_ids)
        cached = start
        keys, values = self._empty_kv(total, reserve, fill=False)                 # [L, H, N + reserve, D]
        keys[:, :, cached:total], values[:, :, cached:total] = 0, 0   # the suffix's slots, written layer by layer
        loader = LayerLoader(sources, bounds, keys, values, self.shifter, self.backend.stager(), pipelined=pipeline)
        try:
            cache = BlendCache(keys, values, length=total)   # the reserve: decode room, never read before written
            cache.deviation_on = self.deviation
            cache.before_read = loader.wait
            cache.stored = stored
            clock.lap("assemble")
            result = yield from self._blend(ids, sources, bounds, cache, ratio, policy, seed, clock)
        finally:
            loader.close()
        cache.before_read = None
        result.stats.pipelined, result.stats.load_wait_ms = loader.pipelined, round(loader.wait_s * 1000, 3)
        return result

    def _blend(self, ids: torch.Tensor, segments: list[LayerSource], bounds: list[tuple[int, int]],
               cache: BlendCache, ratio: float, policy: Policy, seed: int, clock: _Clock
               ) -> Generator[int, None, Prefill]:
        """Steps 2-4 over the laid-out cache (its layers may still be loading)."""
        total, cached = ids.numel(), bounds[-1][1] if bounds else 0
        # 2. The exact prefix needs nothing; the rest of the cached tokens (the candidates) may be repaired.
        exact = self._exact_prefix(segments)
        forced = torch.cat([torch.arange(lo, hi) for s, (lo, hi) in zip(segments, bounds) if isinstance(s, Fresh)]
                           or [torch.empty(0, dtype=torch.long)]).to(self.device) - exact   # [f] candidate rows
        n_select = round(ratio * (cached - exact - forced.numel()))
        stats = PrefillStats(total, cached - forced.numel(), exact, n_select, ratio)
        scores = torch.full((total,), float("nan"))
        suffix = torch.arange(cached, total, device=self.device)
        if n_select == 0 and forced.numel():  # only the fresh spans and the question run
            hidden, run, first = self._keep(ids, forced + exact, suffix, None, None, 0)
            hidden = yield from self._layers(hidden, run, cache, 0, self.num_layers)
            return self._finish(cache, hidden, clock, run[:forced.numel()], scores, stats)
        if n_select == 0:     # full reuse: only the question runs
            hidden = yield from self._layers(self._embed(ids, suffix), suffix, cache, 0, self.num_layers)
            return self._finish(cache, hidden, clock, torch.empty(0, dtype=torch.long), scores, stats)
        if n_select + forced.numel() == cached - exact:  # every candidate: full prefill
            run = torch.arange(exact, total, device=self.device)
            hidden = yield from self._layers(self._embed(ids, run), run, cache, 0, self.num_layers)
            return self._finish(cache, hidden, clock, run[:cached - exact], scores, stats)

        # 3. Score the candidates with what the policy reads (the fresh ones are picked whatever they score).
        ctx = SelectionContext(n_select + forced.numel(), exact, cached, self.num_layers, seed=seed, forced=forced)
        stats.selection = policy.name
        if policy.question_layers:  # the question alone over the cached keys (cost ≈ its own length)
            layers = policy.layer_range(self.num_layers)
            probe = _QuestionAttention(ctx, len(suffix), total, layers, self.device)
            yield from self._layers(self._embed(ids, suffix), suffix, cache, 0, layers.stop, probe)
            clock.lap("question_pass")
        first, run, hidden = 0, None, None
        if policy.deviation:         # every candidate through layers 0..check_layer
            run = torch.arange(exact, total, device=self.device)
            cache.deviation_layers = frozenset({self.check_layer})
            hidden = yield from self._layers(self._embed(ids, run), run, cache, 0, self.check_layer + 1)
            ctx.layer, ctx.deviation = self.check_layer, cache.deviation(self.check_layer)[:cached - exact]
            first = self.check_layer + 1
            clock.lap("layers_full")
        picked, candidate_scores = select(policy, ctx)  # scores read back once, here
        scores[exact:cached] = candidate_scores.cpu()

        # 4. The selected candidates plus the suffix run the remaining layers.
        hidden, run, first = self._keep(ids, picked + exact, suffix, hidden, run, first)
        hidden = yield from self._layers(hidden, run, cache, first, self.num_layers)
        return self._finish(cache, hidden, clock, run[:ctx.count], scores, stats)

    def _embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.decoder.embed_tokens(ids[positions][None])                  # [1, T, hidden]

    def _keep(self, ids: torch.Tensor, selected: torch.Tensor, suffix: torch.Tensor, hidden: torch.Tensor | None,
              run: torch.Tensor | None, first: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(hidden, positions, layer) to go on with just `selected` + the suffix; from layer 0 when
        no layer has run yet (layer 0's K/V are exact for every token, so nothing is lost)."""
        keep = torch.cat([selected.to(suffix.device), suffix])
        if hidden is None:
            return self._embed(ids, keep), keep, 0
        index = torch.searchsorted(run, keep)           # rows of `hidden` (run is sorted)
        return hidden[:, index], keep, first

    def _layers(self, hidden: torch.Tensor, run: torch.Tensor, cache: BlendCache, start: int, stop: int,
                probe: Callable | None = None) -> Generator[int, None, torch.Tensor]:
        """Run decoder layers [start, stop) for the tokens at absolute positions `run` (hidden [1, T, hidden]),
        each layer a chunk of rows at a time, yielding after each chunk (a scheduler's slice boundary); returns
        the last hidden states."""
        chunks = self._chunks(run.numel())
        # Which keys each chunk's queries see, planned once for all these layers (the hint, every key of the
        # prompt, spares a GPU reading the positions back: the plan masks the keys after a chunk's last query).
        plans = [self.backend.plan(run[rows], num_keys=cache.layers[0].keys.shape[2]) for rows in chunks]
        # the stored spans each chunk rounds (none in the question's probe: it only scores the selection)
        due = _due(run, chunks, cache.stored.spans) if cache.stored and probe is None else [[] for _ in chunks]
        cos, sin = self.decoder.rotary_emb(hidden, position_ids=run[None])      # each [1, T, head_dim]
        for layer in self.decoder.layers[start:stop]:
            out = []                                                              # each [1, rows, hidden]
            for rows, plan, spans in zip(chunks, plans, due):
                cache.write_positions, cache.round_trip_now = run[rows], spans
                out.append(layer(hidden[:, rows], attention_mask=None, position_ids=run[None, rows], cache=cache,
                                 position_embeddings=(cos[:, rows], sin[:, rows]), attention_plan=plan,
                                 attention_probe=probe))
                yield rows.stop - rows.start
            hidden = out[0] if len(out) == 1 else torch.cat(out, dim=1)
        cache.round_trip_now = []
        return hidden

    def _chunks(self, rows: int) -> list[slice]:
        """A layer's rows cut into the fewest chunks of at most chunk_tokens, of (nearly) equal size."""
        pieces = 1 if self.chunk_tokens is None else -(-rows // self.chunk_tokens)
        size = -(-rows // pieces)
        return [slice(a, min(a + size, rows)) for a in range(0, rows, size)]

    def _finish(self, cache: BlendCache, hidden: torch.Tensor, clock: _Clock, selected: torch.Tensor,
                scores: torch.Tensor, stats: PrefillStats) -> Prefill:
        cache.write_positions, cache.deviation_layers, cache.deviations = None, frozenset(), {}
        logits = self.model.lm_head(self.decoder.norm(hidden[:, -1]))[0]        # [V], on the host below
        clock.lap("layers_selected" if len(clock.timings) > 1 else "layers")
        stats.timings_ms = clock.timings
        return Prefill(cache, logits.float().cpu(), stats.prompt_tokens, selected.cpu(), stats, scores)

    def _window_refusal(self, tokens: int) -> str | None:
        if self.sliding_window is not None and tokens > self.sliding_window:
            return (f"prompt of {tokens} tokens exceeds the {self.sliding_window}-token sliding window, "
                    "which the blend attention does not apply")
        return None

    def _exact_prefix(self, segments: Sequence[LayerSource]) -> int:
        """Tokens of leading segments computed at their own position after exactly what precedes them."""
        exact, before = 0, []
        for seg in segments:
            if seg.position != exact or seg.context_hash != hash_ids(before):
                break
            before += seg.token_ids.tolist()
            exact += len(seg.token_ids)
        return exact

    def _check_segment(self, seg: LayerSource) -> None:
        if isinstance(seg, Fresh):
            return
        if seg.fingerprint != self.fingerprint:
            raise KVMismatchError(f"chunk KV belongs to model {seg.fingerprint}, not {self.fingerprint}")
        expected = (self.num_layers, self.kv_heads, len(seg.token_ids), self.head_dim)
        if tuple(seg.shape) != expected:
            raise KVMismatchError(f"chunk KV has shape {tuple(seg.shape)}, this model needs {expected}")

    def _empty_kv(self, length: int, reserve: int = 0, fill: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V [L, H, length + reserve, D], zeroed unless `fill` is False (the reserve is decode room)."""
        shape = (self.num_layers, self.kv_heads, length + reserve, self.head_dim)
        keys, values = (self.backend.empty(shape, self.dtype) for _ in range(2))
        if fill:
            keys.zero_()
            values.zero_()
        return keys, values

    @property
    def cpu_kernels(self) -> bool:
        """Whether the CPU kernels run this model's steps (blend.cpu_kernels; the backend decided)."""
        return self.backend.kernels

    @torch.inference_mode()
    def teacher_force(self, prefill: Prefill, target_ids: Sequence[int]) -> torch.Tensor:
        """Logits [len(target_ids), V] predicting each target token after the prompt (extends the cache)."""
        target = list(target_ids)
        if len(target) <= 1:
            return prefill.logits[None, :][: len(target)]
        positions = torch.arange(prefill.num_tokens, prefill.num_tokens + len(target) - 1, device=self.device)[None]
        out = self.model(input_ids=torch.tensor([target[:-1]], device=self.device), position_ids=positions,
                         cache=prefill.cache, use_cache=True)
        return torch.cat([prefill.logits[None], out.logits[0].float().cpu()])


def _due(run: torch.Tensor, chunks: list[slice], spans: Sequence[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """For each chunk of the (sorted) positions `run`, the spans whose last position it is the first to reach: their
    K/V are final for the layer once its write is done (read or written before; the suffix, always in the last
    chunk, is past every span). One read of the positions to the host."""
    positions = run.tolist()
    last = [positions[rows][-1] for rows in chunks]
    due: list[list[tuple[int, int]]] = [[] for _ in chunks]
    for start, end in spans:
        chunk = next((i for i, p in enumerate(last) if p >= end - 1), len(chunks) - 1)
        due[chunk].append((start, end))
    return due


