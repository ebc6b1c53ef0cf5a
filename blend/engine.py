"""Blender: CacheBlend selective recompute through the model's own HF decoder layers.

Contract:
    precompute(ids, context_ids) -> ChunkKV        a chunk's K/V, computed after `context_ids`
    prefill(segments, suffix_ids, ratio) -> Prefill
        segments: cached ChunkKVs laid out in order; the suffix is always computed fresh.
        ratio 1 reproduces full prefill, ratio 0 is full reuse (shifted KV concatenated).
    full_prefill(ids) -> Prefill                   the model's own forward over every token
    decode(prefill, sampling) -> Iterator[int]     greedy / sampled tokens from the prefill cache

The blended prefill, step by step:
    1. lay the segments and suffix out at absolute positions; RoPE-shift each segment's keys
    2. leading segments computed after exactly the tokens before them are exact (prefix cache)
    3. layers 0..check_layer run every other token; at the check layer each cached token's
       K/V deviation (fresh vs cached) is measured
    4. keep the top `ratio` of cached tokens by deviation plus the suffix; later layers run only
       those, writing fresh K/V over the cached ones, queries attending to all keys causally
       (blend.attention plans that attention so only the visible keys are computed)

Models the loop cannot run exactly (blend.gate, plus a probe prompt at start-up) and prompts longer
than a sliding window run full prefill instead; `unsupported` / `PrefillStats.fallback` say why.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Iterator, Literal, Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from blend.attention import BLEND_ATTENTION, AttentionPlan
from blend.cache import BlendCache
from blend.chunk_kv import ChunkKV, KVMismatchError, hash_ids
from blend.decode import SamplingParams, sample_next
from blend.gate import sliding_window, static_refusal
from blend.rope import RopeShifter, RopeUnsupportedError

log = logging.getLogger("ragblend.blend")

Selection = Literal["hkvd", "random"]


@dataclass
class PrefillStats:
    prompt_tokens: int
    cached_tokens: int = 0       # tokens whose K/V came from segments
    exact_tokens: int = 0        # of those, the exact prefix (never recomputed)
    recomputed_tokens: int = 0   # cached tokens recomputed after the check layer
    ratio: float = 1.0
    fallback: str | None = None  # why a blend ran as full prefill
    timings_ms: dict[str, float] = field(default_factory=dict)


@dataclass
class Prefill:
    cache: BlendCache
    logits: torch.Tensor           # [V] next-token logits after the prompt
    num_tokens: int
    selected: torch.Tensor         # absolute positions of cached tokens recomputed after the check layer
    stats: PrefillStats
    # [N] the selection score of each cached non-exact token (HKVD: its deviation at the check
    # layer); NaN where nothing was scored (exact prefix, suffix, full reuse, full prefill)
    scores: torch.Tensor | None = None


class _Clock:
    def __init__(self) -> None:
        self.timings: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.timings[name] = round((now - self._last) * 1000, 3)
        self._last = now


class Blender:
    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, fingerprint: str, *,
                 check_layer: int = 1, deviation: Literal["value", "key"] = "value"):
        self.model, self.tokenizer, self.fingerprint = model, tokenizer, fingerprint
        self.decoder = model.model
        config = model.config.get_text_config(decoder=True)
        self.num_layers = config.num_hidden_layers
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.check_layer = min(check_layer, self.num_layers - 1)
        self.deviation = deviation
        self.dtype = next(model.parameters()).dtype
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
            reason = self._probe()
        if reason and self.model.config._attn_implementation == BLEND_ATTENTION:
            fallback = own if own != BLEND_ATTENTION else "sdpa" if self.model._supports_sdpa else "eager"
            self.model.set_attn_implementation(fallback)
        return reason

    def _probe(self) -> str | None:
        """A short prompt blended at ratio 1 (an exact prefix, a moved chunk, a suffix) must match the model."""
        n = max(3, min(12, self.sliding_window or 12))  # within the window, so the probe really blends
        ids = (torch.arange(n) * 7 % self.model.config.get_text_config(decoder=True).vocab_size).tolist()
        a, b = n // 3, 2 * n // 3
        segments = [self.precompute(ids[:a]), self.precompute(ids[a:b])]
        blended = self.prefill(segments, ids[b:], 1.0).logits
        own = self.full_prefill(ids).logits
        tolerance = (1e-4 if self.dtype == torch.float32 else 2e-2) * (1 + float(own.abs().max()))
        error = float((blended - own).abs().max())
        if not error <= tolerance:
            return (f"the blend loop does not reproduce {type(self.model).__name__}'s own forward "
                    f"(max |logit difference| {error:.3g} on a probe prompt)")
        return None

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
            cache = BlendCache(context.keys.to(self.dtype).clone(), context.values.to(self.dtype).clone())
            new_ids = ids
        else:
            cache, new_ids = BlendCache(*self._empty_kv(0)), context_ids + ids
        positions = torch.arange(len(context_ids) + len(ids))[None, -len(new_ids):]
        self.decoder(input_ids=torch.tensor([new_ids]), position_ids=positions, cache=cache, use_cache=True)
        keys = torch.stack([layer.keys[0, :, start:] for layer in cache.layers])   # [L, H, T, D]
        values = torch.stack([layer.values[0, :, start:] for layer in cache.layers])
        return ChunkKV(keys, values, torch.tensor(ids), start, hash_ids(context_ids), self.fingerprint)

    # ---- prefill --------------------------------------------------------------------------

    @torch.inference_mode()
    def full_prefill(self, ids: Sequence[int]) -> Prefill:
        """Every token through the model's own forward (its own attention, masks and head): the reference."""
        clock = _Clock()
        ids = list(ids)
        cache = BlendCache(*self._empty_kv(0))
        out = self.model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True, logits_to_keep=1)
        clock.lap("layers")
        stats = PrefillStats(len(ids), timings_ms=clock.timings)
        return Prefill(cache, out.logits[0, -1].float(), len(ids), torch.empty(0, dtype=torch.long), stats,
                       torch.full((len(ids),), float("nan")))

    @torch.inference_mode()
    def prefill(self, segments: Sequence[ChunkKV], suffix_ids: Sequence[int], ratio: float, *,
                selection: Selection = "hkvd", seed: int = 0) -> Prefill:
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"ratio must be in [0, 1], got {ratio}")
        if not suffix_ids:
            raise ValueError("the suffix must hold at least one token (the question)")
        clock = _Clock()
        for seg in segments:
            self._check_segment(seg)
        ids = torch.cat([s.token_ids for s in segments] + [torch.tensor(list(suffix_ids), dtype=torch.int64)])
        reason = self.unsupported or self._window_refusal(ids.numel())
        if reason:  # the loop would not be exact: run the same tokens through the model's own forward
            log.debug("full prefill instead of blending", extra={"reason": reason})
            result = self.full_prefill(ids.tolist())
            result.stats.fallback = reason
            return result

        # 1. Layout and cache: cached K/V rotated to their new positions.
        total, cached = ids.numel(), sum(s.num_tokens for s in segments)
        keys, values = self._empty_kv(total, fill=False)                          # [L, H, N, D]
        keys[:, :, cached:], values[:, :, cached:] = 0, 0   # the suffix's slots, written layer by layer
        start = 0
        for seg in segments:
            end = start + seg.num_tokens
            keys[:, :, start:end] = self.shifter.shift(seg.keys.to(self.dtype), start - seg.position)
            values[:, :, start:end] = seg.values
            start = end
        cache = BlendCache(keys, values)
        clock.lap("assemble")

        # 2. The exact prefix needs nothing; the rest of the cached tokens may be repaired.
        exact = self._exact_prefix(segments)
        n_select = round(ratio * (cached - exact))
        suffix_pos = torch.arange(cached, total)
        # 3. Up to the check layer, run every non-exact token (just the suffix for full reuse).
        run = torch.arange(exact, total) if n_select else suffix_pos
        hidden = self.decoder.embed_tokens(ids[run][None])                       # [1, Tq, hidden]
        plan = None
        cache.check_layer, cache.deviation_on = self.check_layer, self.deviation
        selected = torch.arange(exact, cached) if n_select == cached - exact else torch.empty(0, dtype=torch.long)
        for i, layer in enumerate(self.decoder.layers[: self.num_layers]):
            if n_select and i == self.check_layer + 1 and n_select < cached - exact:
                # 4. Keep the top deviations among cached tokens, plus the suffix.
                selected = self._select(cache.deviation[: cached - exact], n_select, selection, seed) + exact
                keep = torch.cat([selected, suffix_pos])
                hidden = hidden[:, keep - exact]
                run = keep
                clock.lap("layers_full")
            if plan is None or run is not plan.positions:  # new queries: plan their attention and RoPE once
                plan = AttentionPlan.build(run)
                position_embeddings = self.decoder.rotary_emb(hidden, position_ids=run[None])
            cache.write_positions = run
            hidden = layer(hidden, attention_mask=None, position_ids=run[None], cache=cache,
                           position_embeddings=position_embeddings, attention_plan=plan)
        scores = torch.full((total,), float("nan"))
        if n_select and cache.deviation is not None:
            scores[exact:cached] = cache.deviation[: cached - exact].float()
        cache.write_positions = cache.deviation = None
        logits = self.model.lm_head(self.decoder.norm(hidden[:, -1]))[0]        # [V]
        clock.lap("layers_selected" if "layers_full" in clock.timings else "layers")
        stats = PrefillStats(total, cached, exact, len(selected), ratio, timings_ms=clock.timings)
        return Prefill(cache, logits.float(), total, selected, stats, scores)

    def _window_refusal(self, tokens: int) -> str | None:
        if self.sliding_window is not None and tokens > self.sliding_window:
            return (f"prompt of {tokens} tokens exceeds the {self.sliding_window}-token sliding window, "
                    "which the blend attention does not apply")
        return None

    def _exact_prefix(self, segments: Sequence[ChunkKV]) -> int:
        """Tokens of leading segments computed at their own position after exactly what precedes them."""
        exact, before = 0, []
        for seg in segments:
            if seg.position != exact or seg.context_hash != hash_ids(before):
                break
            before += seg.token_ids.tolist()
            exact += seg.num_tokens
        return exact

    @staticmethod
    def _select(deviation: torch.Tensor, count: int, selection: Selection, seed: int) -> torch.Tensor:
        """Indices (sorted) of `count` tokens: highest deviation (HKVD), or random as a baseline."""
        if selection == "random":
            picked = torch.randperm(deviation.numel(), generator=torch.Generator().manual_seed(seed))[:count]
        else:
            picked = deviation.topk(count).indices
        return picked.sort().values

    def _check_segment(self, seg: ChunkKV) -> None:
        if seg.fingerprint != self.fingerprint:
            raise KVMismatchError(f"chunk KV belongs to model {seg.fingerprint}, not {self.fingerprint}")
        expected = (self.num_layers, self.kv_heads, seg.num_tokens, self.head_dim)
        if tuple(seg.keys.shape) != expected:
            raise KVMismatchError(f"chunk KV has shape {tuple(seg.keys.shape)}, this model needs {expected}")

    def _empty_kv(self, length: int, fill: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.num_layers, self.kv_heads, length, self.head_dim)
        make = torch.zeros if fill else torch.empty
        return make(shape, dtype=self.dtype), make(shape, dtype=self.dtype)

    # ---- decode ---------------------------------------------------------------------------

    @property
    def eos_ids(self) -> frozenset[int]:
        ids = self.model.generation_config.eos_token_id
        ids = ids if isinstance(ids, list) else [ids]
        return frozenset(i for i in [*ids, getattr(self.tokenizer, "eos_token_id", None)] if i is not None)

    def decode(self, prefill: Prefill, sampling: SamplingParams = SamplingParams()) -> Iterator[int]:
        """Yield generated token ids (eos included, then stop) from the prefill's cache."""
        generator = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
        logits, position, eos = prefill.logits, prefill.num_tokens, self.eos_ids
        for step in range(sampling.max_new_tokens):
            token = sample_next(logits, sampling, generator)
            yield token
            if token in eos or step == sampling.max_new_tokens - 1:
                return
            with torch.inference_mode():
                out = self.model(input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[position]]),
                                 cache=prefill.cache, use_cache=True)
            logits, position = out.logits[0, -1].float(), position + 1

    @torch.inference_mode()
    def teacher_force(self, prefill: Prefill, target_ids: Sequence[int]) -> torch.Tensor:
        """Logits [len(target_ids), V] predicting each target token after the prompt (extends the cache)."""
        target = list(target_ids)
        if len(target) <= 1:
            return prefill.logits[None, :][: len(target)]
        positions = torch.arange(prefill.num_tokens, prefill.num_tokens + len(target) - 1)[None]
        out = self.model(input_ids=torch.tensor([target[:-1]]), position_ids=positions, cache=prefill.cache,
                         use_cache=True)
        return torch.cat([prefill.logits[None], out.logits[0].float()])
