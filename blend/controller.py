"""The loading controller: from measured costs, which chunks to load (from which tier) and how much to recompute.

A pure function (`plan_loading`) of numbers, so it is tested without a model:
- per chunk (CacheGen): loading its stored KV from a tier costs, per layer, the layer's stored bytes over the
  tier's bandwidth plus the same bytes over its codec's decode rate; recomputing it from text costs
  `tokens * recompute cost` per layer. A chunk held by several tiers is loaded from the cheapest; when even
  that is slower than recomputing, it is recomputed from text instead.
- the ratio (CacheBlend): pipelined, layer i+1 loads while layer i computes, so loading is hidden
  when the load of one layer (every loaded chunk's layer, read one after another) takes no longer
  than the compute of one layer: `cost * (r * cached tokens + question tokens)`. The controller
  picks the smallest r >= the floor (blend.ratio, the quality floor) that hides the load; more
  recompute costs nothing then (the layer would wait for its KV anyway) and repairs more tokens.
  A policy with a question pass (blend.selection "query") needs its layers' KV before the main
  pass starts: only the rest (`overlap`, the share of layers after the question pass) can hide
  behind the main pass, so the compute that pays for itself is `overlap` x the load.

`blend_or_whole` (the planner's choice, also pure): the predicted prefill time of blending a prompt's found spans
against computing it whole (after its exact prefix), from the same rates and the measured cost of each blended span
per layer (its read, RoPE shift and layout, its own run of keys), and the cheaper taken.

`Calibration` keeps the measured inputs as moving averages: the per-token-per-layer recompute cost (a prefill's
layers' time over the tokens they ran; a question pass's rows are priced at it too: measured apart, its tiny passes
gave per-token rates 3-4x too dear), each blended span's per layer (the
time a blended prefill waited for its reads and laid them out), each tier's bandwidth and each codec's decode rate
(from the store's per-layer read and decode counts, real reads), and each codec's stored bytes per token and layer
(to price a copy of a chunk in a tier it was not opened from). A rate not measured yet counts as free: the chunk is
loaded, and measured.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Source:
    """Where a chunk's KV can be loaded from."""

    tier: str
    codec: str | None  # how that tier keeps it (None: tensors, nothing to decode)
    layer_bytes: int   # one layer of it, as stored


@dataclass(frozen=True)
class ChunkCost:
    tokens: int
    sources: tuple[Source, ...] = ()  # every tier known to hold it; none: its KV is already at hand (free)


@dataclass
class Rates:
    """Measured costs, as plain numbers (a `Calibration.snapshot`, or given outright)."""

    recompute_s: float                                    # one token through one layer
    bandwidth: dict[str, float] = field(default_factory=dict)    # tier -> stored bytes read per second
    decode_rate: dict[str, float] = field(default_factory=dict)  # codec -> stored bytes decoded per second
    span_s: float = 0.0                                   # one blended span, one layer: its reads not hidden

    def load_s(self, source: Source) -> float:
        """Seconds to load one layer of a chunk from `source` (an unmeasured rate costs nothing)."""
        read = self.bandwidth.get(source.tier)
        decode = self.decode_rate.get(source.codec)
        return source.layer_bytes * ((1 / read if read else 0.0) + (1 / decode if decode else 0.0))


@dataclass
class LoadPlan:
    ratio: float
    load: list[bool]                 # per chunk: True = use its KV (at hand, or loaded), False = recompute it from text
    sources: list[Source | None]     # per chunk: the tier to load it from (None: at hand, or recomputed)
    reason: str
    load_ms_per_layer: float         # the chunks left to load, one layer of each
    compute_ms_per_layer: float      # one layer's compute at `ratio`

    def as_dict(self) -> dict:
        return {"ratio": round(self.ratio, 4), "recompute_from_text": [i for i, x in enumerate(self.load) if not x],
                "load_from": [s and s.tier for s in self.sources], "reason": self.reason,
                "load_ms_per_layer": round(self.load_ms_per_layer, 3),
                "compute_ms_per_layer": round(self.compute_ms_per_layer, 3)}


def plan_loading(chunks: list[ChunkCost], rates: Rates, *, floor: float, suffix_tokens: int,
                 overlap: float = 1.0) -> LoadPlan:
    """The ratio (>= floor) and per-chunk source (or recompute from text) for one prompt.

    overlap: share of the load that can hide behind the main pass (see `overlap_share`).
    """
    if not 0.0 <= floor <= 1.0:
        raise ValueError(f"the ratio floor must be in [0, 1], got {floor}")
    if rates.recompute_s <= 0:
        raise ValueError(f"recompute cost must be positive, got {rates.recompute_s}")
    load, sources, text = [], [], []
    for i, c in enumerate(chunks):
        best = min(c.sources, key=rates.load_s, default=None)  # None: no source, its KV is at hand
        load_s, compute_s = (rates.load_s(best) if best else 0.0), c.tokens * rates.recompute_s
        load.append(load_s <= compute_s)
        sources.append(best if load_s <= compute_s else None)
        if load_s > compute_s:
            text.append(f"chunk {i} recomputed from text ({best.tier}: {load_s * 1e3:.1f} ms a layer to load, "
                        f"{compute_s * 1e3:.1f} ms to recompute)")
    per_layer_load = sum(rates.load_s(s) for s in sources if s is not None)
    cached = sum(c.tokens for c, kept in zip(chunks, load) if kept)

    def compute(r: float) -> float:
        return rates.recompute_s * (r * cached + suffix_tokens)

    target = per_layer_load * overlap  # compute per layer that runs while loads are still arriving
    if compute(floor) >= target or cached == 0:
        ratio, why = floor, "loading hidden at the floor ratio"
    else:
        ratio = min(1.0, (target / rates.recompute_s - suffix_tokens) / cached)
        why = (f"ratio raised from {floor} so each layer's compute covers its load" if ratio < 1.0 else
               "loading dominates even at ratio 1")
    return LoadPlan(ratio, load, sources, "; ".join([why, *text]), per_layer_load * 1e3, compute(ratio) * 1e3)


@dataclass(frozen=True)
class Choice:
    """The planner's prediction for one prompt past its exact prefix, in seconds."""

    blend_s: float
    whole_s: float

    @property
    def blend(self) -> bool:
        return self.blend_s <= self.whole_s  # a tie keeps the spans found

    def as_dict(self) -> dict:
        return {"blend": self.blend, "blend_ms": round(self.blend_s * 1e3, 1), "whole_ms": round(self.whole_s * 1e3, 1)}


def blend_or_whole(chunks: Sequence[ChunkCost], computed: int, rates: Rates, *, layers: int, ratio: float,
                   question_tokens: int = 0, question_layers: int = 0, check_layers: int = 0,
                   pipelined: bool = True) -> Choice:
    """Blending `chunks` (the spans found, read and RoPE-shifted, `ratio` of their tokens recomputed) with the
    `computed` tokens (the spans not found and the question) against computing all of them. A layer of a blend
    computes its share and loads every chunk's layer (pipelined: the slower of the two, the first layer's load
    unhidden) and pays each span's own cost; the selection runs first: a question pass (`question_tokens` through
    `question_layers`) or every cached token through `check_layers` (hkvd). A chunk slower to load than to
    recompute is recomputed from text either way (`plan_loading`)."""
    whole = rates.recompute_s * layers * (sum(c.tokens for c in chunks) + computed)
    loads = [min(map(rates.load_s, c.sources), default=0.0) for c in chunks]    # one layer of each chunk
    kept = [(c, s) for c, s in zip(chunks, loads) if s <= c.tokens * rates.recompute_s]
    if not kept:  # each chunk recomputed from text (plan_loading): a tie, the loading controller decides each
        return Choice(whole, whole)
    computed += sum(c.tokens for c in chunks) - sum(c.tokens for c, _ in kept)
    chunks, load = [c for c, _ in kept], sum(s for _, s in kept)
    cached = sum(c.tokens for c in chunks)
    compute = rates.recompute_s * (ratio * cached + computed)                    # one layer
    per_layer = (max(compute, load) if pipelined else compute + load) + rates.span_s * len(chunks)
    selection = rates.recompute_s * (question_tokens * question_layers + cached * check_layers)
    return Choice(layers * per_layer + (load if pipelined else 0.0) + selection, whole)


def overlap_share(question_layers: range | None, num_layers: int) -> float:
    """Share of the layers whose load can overlap the main pass: all of them, or, after a question pass
    over layers [0, stop), the layers after it (those before it were needed first)."""
    if not question_layers:
        return 1.0
    return max(0.0, (num_layers - question_layers.stop) / num_layers)


@dataclass
class Calibration:
    """Measured costs, updated from live timings (exponential moving averages, weight `alpha`)."""

    recompute_s: float | None = None                           # per token per layer
    span_s: float | None = None                                # per blended span per layer: reads not hidden
    bandwidth: dict[str, float] = field(default_factory=dict)    # stored bytes/s per tier
    decode_rate: dict[str, float] = field(default_factory=dict)  # stored bytes/s per codec
    token_layer_bytes: dict[str, float] = field(default_factory=dict)  # stored bytes of a token in a layer, per codec
    alpha: float = 0.2
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # every prefill's work so far: token-layers run, their seconds, blended span-layers, their seconds (`settled`)
    _work: list[float] = field(default_factory=lambda: [0.0] * 4, repr=False)
    _totals: dict[tuple[str, str], tuple[float, ...]] = field(default_factory=dict, repr=False)  # last seen

    def observe_compute(self, tokens_through_layers: float, seconds: float) -> None:
        """`seconds` spent running `tokens_through_layers` (tokens x layers) through decoder layers."""
        if tokens_through_layers > 0 and seconds > 0:
            with self._lock:
                self.recompute_s = _ema(self.recompute_s, seconds / tokens_through_layers, self.alpha)

    def observe_prefill(self, token_layers: float, seconds: float, *, spans: tuple[float, float] = (0, 0.0)) -> None:
        """A prefill's layers ran `token_layers` (tokens x layers) in `seconds` (its reads' waits not counted); its
        blended spans `spans` (span-layers, the seconds its layers waited for their reads and its layout took)."""
        self.observe_compute(token_layers, seconds)
        with self._lock:
            if spans[0] > 0:
                self.span_s = _ema(self.span_s, max(0.0, spans[1]) / spans[0], self.alpha)
            if token_layers > 0 and seconds > 0:
                for i, value in enumerate((token_layers, seconds, spans[0], max(0.0, spans[1]))):
                    self._work[i] += value

    def settled(self, token_layers: float, span_layers: float) -> Rates | None:
        """The compute and span rates over every prefill so far, each weighed by its work (a prefill of a few
        tokens, mostly the layers' fixed costs, weighs little), once they ran `token_layers` and blended
        `span_layers` in all; None before that. Tier and codec rates as `rates`."""
        with self._lock:
            ran, seconds, spans, span_seconds = self._work
            if ran < token_layers or spans < span_layers:
                return None
            return Rates(seconds / ran, dict(self.bandwidth), dict(self.decode_rate), span_seconds / spans)

    def observe_tier(self, tier: str, nbytes: float, seconds: float) -> None:
        """`nbytes` read (and checked) from `tier` in `seconds`: the store's per-layer read counts."""
        if nbytes > 0 and seconds > 0:
            with self._lock:
                self.bandwidth[tier] = _ema(self.bandwidth.get(tier), nbytes / seconds, self.alpha)

    def observe_codec(self, codec: str, nbytes: float, token_layers: float, seconds: float) -> None:
        """`nbytes` (as stored, `token_layers` tokens x layers) decoded by `codec` in `seconds`."""
        if nbytes > 0 and seconds > 0 and token_layers > 0:
            with self._lock:
                self.decode_rate[codec] = _ema(self.decode_rate.get(codec), nbytes / seconds, self.alpha)
                self.token_layer_bytes[codec] = _ema(self.token_layer_bytes.get(codec), nbytes / token_layers,
                                                     self.alpha)

    def observe_reads(self, tiers: dict[str, dict], codecs: dict[str, dict]) -> None:
        """The store's read counts (store.TieredStore.counts and decode_counts: running totals, plain dicts):
        the reads since the last call move each tier's bandwidth and each codec's decode rate."""
        for tier, t in tiers.items():
            nbytes, seconds = self._since(("tier", tier), (t["layer_bytes"], t["layer_s_total"]))
            self.observe_tier(tier, nbytes, seconds)
        for codec, c in codecs.items():
            nbytes, token_layers, seconds = self._since(("codec", codec),
                                                        (c["bytes"], c["token_layers"], c["decode_s_total"]))
            self.observe_codec(codec, nbytes, token_layers, seconds)

    def _since(self, name: tuple[str, str], totals: tuple[float, ...]) -> tuple[float, ...]:
        with self._lock:
            last = self._totals.get(name, (0.0,) * len(totals))
            self._totals[name] = totals
        return tuple(now - before for now, before in zip(totals, last))

    def rates(self) -> Rates | None:
        """The measured rates, or None before any compute cost was measured."""
        with self._lock:
            if self.recompute_s is None:
                return None
            return Rates(self.recompute_s, dict(self.bandwidth), dict(self.decode_rate), self.span_s or 0.0)

    def estimate(self, tier: str, codec: str, tokens: int) -> Source | None:
        """A chunk of `tokens` tokens in `tier` as `codec` keeps it, priced by that codec's measured bytes per
        token (None until that codec was read once)."""
        with self._lock:
            per_token = self.token_layer_bytes.get(codec)
        return None if per_token is None else Source(tier, codec, int(per_token * tokens))

    def snapshot(self) -> dict:
        with self._lock:
            return {"recompute_us_per_token_layer": None if self.recompute_s is None else self.recompute_s * 1e6,
                    "span_us_per_layer": None if self.span_s is None else self.span_s * 1e6,
                    "tier_bandwidth_mb_s": {t: round(b / 1e6, 2) for t, b in self.bandwidth.items()},
                    "codec_decode_mb_s": {c: round(r / 1e6, 2) for c, r in self.decode_rate.items()}}


def _ema(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else (1 - alpha) * old + alpha * new
