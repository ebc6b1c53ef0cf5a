"""blend.ratio: auto — the loading controller (blend.controller) as a request runs it: this process's
measured recompute cost, store-tier bandwidths and codec decode rates in; each prompt's ratio, which
passages to recompute from text rather than load, and which tier to load the others from out
(app/components.py builds it; app.engine.rag_engine calls it)."""
from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any, Protocol

from blend import Blender, ChunkKV
from blend.controller import Calibration, Choice, ChunkCost, Rates, Source, blend_or_whole, overlap_share, plan_loading
from blend.pipeline import LayerSource
from blend.selection import get_policy
from store import ResidentEntry, TieredStore

SETTLE_TOKENS, SETTLE_SPANS = 256, 8  # the work measured before plans are priced (planning_rates)


class Piece(Protocol):
    """A cached piece of the prompt (app.engine.rag_engine's): its tokens, where its KV came from, the KV."""

    ids: list[int]
    tier: str | None
    kv: ChunkKV | LayerSource | None


class LoadingControl:
    def __init__(self, blender: Blender, store: TieredStore, floor: float):
        self.blender, self.store, self.floor = blender, store, floor
        self.calibration = Calibration()  # measured recompute cost, tier bandwidths and codec decode rates
        self.planning: Rates | None = None  # the rates plans are priced by, fixed once measured (planning_rates)

    def ratio(self, pieces: Sequence[Piece], suffix_tokens: int, selection: str | None,
              recompute: Callable[[Any], ChunkKV]) -> Generator[None, None, tuple[float, dict]]:
        """The controller's ratio for this prompt and what it decided (the stats' `loading`); passages it
        finds cheaper to recompute from text than to load are recomputed here (a slice each), and those a
        slower tier holds more cheaply (a smaller codec over a link fast enough) are reopened from it."""
        floor, rates = self.floor, self.calibration.rates()
        if rates is None:
            return floor, {"ratio": floor, "recompute_from_text": [], "reason": "not calibrated yet: the floor"}
        layers = self.blender.num_layers
        policy = get_policy(selection or self.blender.selection)
        choice = plan_loading([ChunkCost(len(p.ids), self._sources(p, rates)) for p in pieces], rates, floor=floor,
                              suffix_tokens=suffix_tokens,
                              overlap=overlap_share(policy.question_layers and policy.layer_range(layers), layers))
        for piece, load, source in zip(pieces, choice.load, choice.sources):
            if isinstance(piece.kv, ChunkKV) or piece.kv is None:
                continue
            if not load:
                piece.kv.close()
                piece.kv = recompute(piece)
                yield
            elif source.tier != piece.kv.tier and (cheaper := self.store.open(piece.kv.key, tier=source.tier)):
                piece.kv.close()
                piece.kv, piece.tier = cheaper, source.tier
        return choice.ratio, choice.as_dict() | self.calibration.snapshot()

    def _sources(self, piece: Piece, rates: Rates) -> tuple[Source, ...]:
        """Where a piece's KV can be loaded from: the entry opened (the fastest tier holding it: the tiers before
        it missed) and any slower tier whose copy the measured rates price below it (asked whether it holds
        one only then). A resident entry's tensors need no decoding; a piece already computed, no loading."""
        entry = piece.kv
        if isinstance(entry, ChunkKV) or entry is None:
            return ()
        opened = Source(entry.tier, None if isinstance(entry, ResidentEntry) else entry.codec, entry.layer_nbytes)
        tiers = [t.name for t in self.store.tiers]
        later = (self.calibration.estimate(t, self.store.codecs[t], len(piece.ids))
                 for t in tiers[tiers.index(entry.tier) + 1:])
        return (opened, *(s for s in later if s is not None and rates.load_s(s) < rates.load_s(opened)
                          and self.store.contains(entry.key, s.tier)))

    def blend_or_whole(self, pieces: Sequence[Piece], computed: int, *, ratio: float, question_tokens: int,
                       pipelined: bool) -> Choice | None:
        """The planner's choice for a prompt past its exact prefix: blend `pieces` (the spans found, opened) with
        the `computed` tokens, or compute them all, priced by the measured rates (None before any prefill ran).
        A piece loads from the tier it was opened from (or a cheaper one: `_sources`)."""
        if (rates := self.planning_rates()) is None:
            return None
        layers, policy = self.blender.num_layers, get_policy(self.blender.selection)
        chunks = [ChunkCost(len(p.ids), self._sources(p, rates) if hasattr(p.kv, "layer_nbytes") else ())
                  for p in pieces]
        return blend_or_whole(chunks, computed, rates, layers=layers, ratio=ratio,
                              question_tokens=question_tokens,
                              question_layers=policy.layer_range(layers).stop if policy.question_layers else 0,
                              check_layers=self.blender.check_layer + 1 if policy.deviation else 0,
                              pipelined=pipelined)

    def planning_rates(self) -> Rates | None:
        """The rates a plan is priced by: the measured ones, fixed once prefills have run SETTLE_TOKENS tokens and
        blended SETTLE_SPANS spans through every layer (the server's warm-up does), weighed by their work; None
        before that (plans blend). A few-dozen-token prefill alone would price a token by the layers' fixed costs.
        Fixed, because a plan decides between blending and computing whole, which may change an answer: the same
        prompt must get the same answer whatever ran before it, not one that turns on its neighbours' timings."""
        if self.planning is None:
            layers = self.blender.num_layers
            self.planning = self.calibration.settled(SETTLE_TOKENS * layers, SETTLE_SPANS * layers)
        return self.planning

    def observe(self, tokens: int, seconds: float, *, spans: tuple[float, float] = (0, 0.0)) -> None:
        """After a prefill: its live costs (`tokens` token-layers computed in `seconds`, its blended span-layers
        and the seconds they cost past the compute: Calibration.observe_prefill), and the store's reads since the
        last prefill: each tier's bandwidth and each codec's decode rate."""
        self.calibration.observe_prefill(tokens, seconds, spans=spans)
        self.calibration.observe_reads(self.store.counts(), self.store.decode_counts())
