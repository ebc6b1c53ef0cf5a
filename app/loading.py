"""blend.ratio: auto — the loading controller (blend.controller) as a request runs it: this process's
measured recompute cost and store-tier bandwidths in, each prompt's ratio and which passages to
recompute from text rather than load out (app/components.py builds it; app.engine calls it)."""
from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any, Protocol

from blend import Blender, ChunkKV
from blend.controller import Calibration, ChunkCost, overlap_share, plan_loading
from blend.pipeline import LayerSource
from blend.selection import get_policy
from store import TieredStore


class Piece(Protocol):
    """A cached piece of the prompt (app.engine's): its tokens, where its KV came from, the KV."""

    ids: list[int]
    tier: str | None
    kv: ChunkKV | LayerSource | None


class LoadingControl:
    def __init__(self, blender: Blender, store: TieredStore, floor: float):
        self.blender, self.store, self.floor = blender, store, floor
        self.calibration = Calibration()  # measured recompute cost and tier bandwidths

    def ratio(self, pieces: Sequence[Piece], suffix_tokens: int, selection: str | None,
              recompute: Callable[[Any], ChunkKV]) -> Generator[None, None, tuple[float, dict]]:
        """The controller's ratio for this prompt and what it decided (the stats' `loading`); passages it
        finds cheaper to recompute from text than to load are recomputed here (a slice each)."""
        floor, cal = self.floor, self.calibration
        if cal.recompute_s is None:
            return floor, {"ratio": floor, "recompute_from_text": [], "reason": "not calibrated yet: the floor"}
        chunks = [ChunkCost(len(p.ids), p.tier or "computed", getattr(p.kv, "layer_nbytes", 0)) for p in pieces]
        layers = self.blender.num_layers
        policy = get_policy(selection or self.blender.selection)
        choice = plan_loading(chunks, floor=floor, suffix_tokens=suffix_tokens, num_layers=layers,
                              recompute_s=cal.recompute_s, bandwidth=cal.bandwidth,
                              overlap=overlap_share(policy.question_layers and policy.layer_range(layers), layers))
        for piece, load in zip(pieces, choice.load):
            if not load and not isinstance(piece.kv, ChunkKV):
                piece.kv.close()
                piece.kv = recompute(piece)
                yield
        return choice.ratio, choice.as_dict() | cal.snapshot()

    def observe(self, tokens: int, seconds: float) -> None:
        """After a blended prefill: its live compute cost (`tokens` token-layers in `seconds`), and each
        tier's bandwidth from the store's per-layer read counts (mean over its reads so far)."""
        self.calibration.observe_compute(tokens, seconds)
        for tier, t in self.store.counts().items():
            if t.get("layer_reads"):
                self.calibration.observe_tier(tier, t["layer_bytes"] / t["layer_reads"], t["layer_ms_mean"])
