"""The loading controller: from measured costs, how much to recompute and which chunks to load at all.

A pure function (`plan_loading`) of numbers, so it is tested without a model:
- per chunk (CacheGen): loading its stored KV takes `layer_bytes * layers / bandwidth` of its tier;
  recomputing it from text takes `tokens * layers * recompute cost`. When loading is the slower
  of the two, the chunk is recomputed from text instead of loaded.
- the ratio (CacheBlend): pipelined, layer i+1 loads while layer i computes, so loading is hidden
  when the load of one layer (every loaded chunk's layer, read one after another) takes no longer
  than the compute of one layer: `cost * (r * cached tokens + question tokens)`. The controller
  picks the smallest r >= the floor (blend.ratio, the quality floor) that hides the load; more
  recompute costs nothing then (the layer would wait for its KV anyway) and repairs more tokens.
  A policy with a question pass (blend.selection "query") needs its layers' KV before the main
  pass starts: only the rest (`overlap`, the share of layers after the question pass) can hide
  behind the main pass, so the compute that pays for itself is `overlap` x the load.

`Calibration` keeps the measured inputs: the per-token-per-layer recompute cost (from prefill
timings) and each tier's bandwidth (from the store's per-layer read stats), as moving averages.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ChunkCost:
    tokens: int
    tier: str          # where its KV is stored
    layer_bytes: int   # one layer's stored K/V (as the codec stores it: fp16 or int8)


@dataclass
class LoadPlan:
    ratio: float
    load: list[bool]                 # per chunk: True = load its stored KV, False = recompute it from text
    reason: str
    load_ms_per_layer: float         # the chunks left to load, one layer of each
    compute_ms_per_layer: float      # one layer's compute at `ratio`

    def as_dict(self) -> dict:
        return {"ratio": round(self.ratio, 4), "recompute_from_text": [i for i, x in enumerate(self.load) if not x],
                "reason": self.reason, "load_ms_per_layer": round(self.load_ms_per_layer, 3),
                "compute_ms_per_layer": round(self.compute_ms_per_layer, 3)}


def plan_loading(chunks: list[ChunkCost], *, floor: float, suffix_tokens: int, num_layers: int,
                 recompute_s: float, bandwidth: dict[str, float], overlap: float = 1.0) -> LoadPlan:
    """The ratio (>= floor) and per-chunk load/recompute choice for one prompt.

    recompute_s: seconds for one token through one layer; bandwidth: bytes/s per tier (a tier not
    in it is taken as free to read); overlap: share of the load that can hide behind the main pass
    (see `overlap_share`).
    """
    if not 0.0 <= floor <= 1.0:
        raise ValueError(f"the ratio floor must be in [0, 1], got {floor}")
    if recompute_s <= 0:
        raise ValueError(f"recompute cost must be positive, got {recompute_s}")
    load, text = [], []
    for c in chunks:
        load_s = c.layer_bytes * num_layers / bandwidth[c.tier] if bandwidth.get(c.tier) else 0.0
        compute_s = c.tokens * num_layers * recompute_s
        load.append(load_s <= compute_s)
        if load_s > compute_s:
            text.append(f"chunk {len(load) - 1} recomputed from text ({c.tier}: {load_s * 1e3:.0f} ms to load, "
                        f"{compute_s * 1e3:.0f} ms to recompute)")
    per_layer_load = sum(c.layer_bytes / bandwidth[c.tier] for c, kept in zip(chunks, load)
                         if kept and bandwidth.get(c.tier))
    cached = sum(c.tokens for c, kept in zip(chunks, load) if kept)

    def compute(r: float) -> float:
        return recompute_s * (r * cached + suffix_tokens)

    target = per_layer_load * overlap  # compute per layer that runs while loads are still arriving
    if compute(floor) >= target or cached == 0:
        ratio, why = floor, "loading hidden at the floor ratio"
    else:
        ratio = min(1.0, (target / recompute_s - suffix_tokens) / cached)
        why = (f"ratio raised from {floor} so each layer's compute covers its load" if ratio < 1.0 else
               "loading dominates even at ratio 1")
    return LoadPlan(ratio, load, "; ".join([why, *text]), per_layer_load * 1e3, compute(ratio) * 1e3)


def overlap_share(question_layers: range | None, num_layers: int) -> float:
    """Share of the layers whose load can overlap the main pass: all of them, or, after a question pass
    over layers [0, stop), the layers after it (those before it were needed first)."""
    if not question_layers:
        return 1.0
    return max(0.0, (num_layers - question_layers.stop) / num_layers)


@dataclass
class Calibration:
    """Measured costs, updated from live timings (exponential moving averages, weight `alpha`)."""

    recompute_s: float | None = None                        # per token per layer
    bandwidth: dict[str, float] = field(default_factory=dict)  # bytes/s per tier
    alpha: float = 0.2
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def observe_compute(self, tokens_through_layers: float, seconds: float) -> None:
        """`seconds` spent running `tokens_through_layers` (tokens x layers) through decoder layers."""
        if tokens_through_layers > 0 and seconds > 0:
            with self._lock:
                self.recompute_s = _ema(self.recompute_s, seconds / tokens_through_layers, self.alpha)

    def observe_tier(self, tier: str, layer_bytes: float, layer_ms_mean: float | None) -> None:
        """A tier's mean per-layer read (the store's `layer_bytes`/`layer_ms_mean` stats)."""
        if layer_ms_mean:
            with self._lock:
                self.bandwidth[tier] = _ema(self.bandwidth.get(tier), layer_bytes / (layer_ms_mean / 1e3), self.alpha)

    def snapshot(self) -> dict:
        with self._lock:
            return {"recompute_us_per_token_layer": None if self.recompute_s is None else self.recompute_s * 1e6,
                    "tier_bandwidth_mb_s": {t: round(b / 1e6, 2) for t, b in self.bandwidth.items()}}


def _ema(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else (1 - alpha) * old + alpha * new
