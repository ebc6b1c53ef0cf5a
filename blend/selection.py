"""Selection policies: which cached tokens a blended prefill recomputes.

A policy is one scoring function in a registry keyed by name. The prefill loop gathers what the
policy says it needs, builds a SelectionContext, asks the policy for one score per candidate
(every cached token after the exact prefix) and recomputes the top `count` of them; it knows no
policy by name. Add a policy with `@register("name", ...)`.

What a policy can ask for (and then read from the SelectionContext):
    deviation=True       every candidate runs layers 0..check_layer; `deviation` [n] is
                         ‖V_fresh − V_cached‖² at the check layer (CacheBlend's HKVD)
    question_layers=(lo, hi)
                         the question (suffix) alone runs layers [0, hi·L) over the cached keys,
                         before anything else: cost ≈ its own length. `attention` {layer: [Hq, n]}
                         holds its softmax attention over the candidates at layers [lo·L, hi·L), per
                         head, averaged over the question's tokens.
A policy that asks for neither runs no full-width layer at all: the selected tokens and the
question start at layer 0 (layer 0's K/V are exact for every token anyway), which lowers the
compute to about ratio + the question's share of a full prefill.

(Two options on any policy were measured and removed: recomputing the first tokens of every chunk, EPIC's
per-chunk attention sinks, and CacheBlend's gradual filtering; neither lowered the KL of `query`:
BENCHMARKS.md, "Selection policies".)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class SelectionContext:
    count: int                                 # how many candidates to recompute
    exact: int                                 # exact-prefix length: candidates are positions exact..cached-1
    cached: int                                # cached tokens in the prompt
    num_layers: int
    layer: int = -1                            # the check layer when `deviation` was measured
    deviation: torch.Tensor | None = None      # [n]
    attention: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [Hq, n]
    seed: int = 0
    forced: torch.Tensor | None = None         # [f] candidate indices picked whatever they score (no KV yet)

    @property
    def n(self) -> int:
        return self.cached - self.exact


Score = Callable[[SelectionContext], torch.Tensor]


@dataclass(frozen=True)
class Policy:
    name: str
    score: Score                                         # ctx -> [n] scores; the top `count` are recomputed
    deviation: bool = False                              # needs layers 0..check_layer over every candidate
    question_layers: tuple[float, float] | None = None   # question pass; attention at layers [lo·L, hi·L)
    doc: str = ""

    def layer_range(self, num_layers: int) -> range:
        """The layers whose question attention the policy reads (at least one)."""
        lo, hi = self.question_layers or (0.0, 0.0)
        stop = max(1, round(hi * num_layers))
        return range(min(round(lo * num_layers), stop - 1), stop)


POLICIES: dict[str, Policy] = {}


def register(name: str, *, deviation: bool = False,
             question_layers: tuple[float, float] | None = None) -> Callable[[Score], Score]:
    def add(fn: Score) -> Score:
        POLICIES[name] = Policy(name, fn, deviation, question_layers, (fn.__doc__ or "").strip())
        return fn
    return add


def get_policy(name: str | Policy) -> Policy:
    if isinstance(name, Policy):
        return name
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown selection policy {name!r}; choose from {', '.join(sorted(POLICIES))}") from None


def select(policy: Policy, ctx: SelectionContext) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted candidate indices of the top `count` scores, the scores [n])."""
    scores = policy.score(ctx).float()
    if scores.shape != (ctx.n,):
        raise ValueError(f"policy {policy.name!r} returned scores of shape {tuple(scores.shape)}, expected ({ctx.n},)")
    ranked = scores
    if ctx.forced is not None and ctx.forced.numel():
        ranked = scores.clone()
        ranked[ctx.forced.to(scores.device)] = float("inf")
    picked = ranked.topk(ctx.count).indices if ctx.count else torch.empty(0, dtype=torch.long, device=scores.device)
    return picked.sort().values, scores


# ---- helpers ------------------------------------------------------------------------------------

def ranks(x: torch.Tensor) -> torch.Tensor:
    """[n] rank of each value in [0, 1] (1 = highest): a scale-free way to combine scores."""
    order = x.argsort()
    r = torch.empty_like(x, dtype=torch.float32)
    r[order] = torch.arange(x.numel(), dtype=torch.float32, device=x.device) / max(x.numel() - 1, 1)
    return r


def question_attention(ctx: SelectionContext, heads: str = "mean") -> torch.Tensor:
    """[n] attention the question pays each candidate (mean over its tokens): the mean over the
    recorded layers of the mean (or max) over heads."""
    per_layer = [a.amax(0) if heads == "max" else a.mean(0) for a in ctx.attention.values()]  # [n] each, on the device
    return sum(per_layer) / len(per_layer) if per_layer else torch.zeros(ctx.n)


# ---- the policies -------------------------------------------------------------------------------

@register("hkvd", deviation=True)
def hkvd(ctx: SelectionContext) -> torch.Tensor:
    """Highest KV deviation at the check layer (CacheBlend)."""
    return ctx.deviation


@register("random")
def random(ctx: SelectionContext) -> torch.Tensor:
    """A seeded random pick: the baseline every other policy must beat."""
    return torch.rand(ctx.n, generator=torch.Generator().manual_seed(ctx.seed))


@register("query", question_layers=(0.27, 0.8))
def query(ctx: SelectionContext) -> torch.Tensor:
    """Attention the question pays each cached token over the cached keys, mean over heads, question
    tokens and the middle layers (a question-only pass: no full-width layer)."""
    return question_attention(ctx)


@register("hybrid", deviation=True, question_layers=(0.27, 0.8))
def hybrid(ctx: SelectionContext) -> torch.Tensor:
    """Rank sum of question attention (as `query`) and deviation at the check layer."""
    return ranks(question_attention(ctx)) + ranks(ctx.deviation)
