"""A request's prompt as pieces (app.engine's plan): each piece's tokens, what it is computed after, where its KV
comes from; the rules that pick, per message piece, exact, blended, computed or fresh (see app.engine)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from app.conversation import CHARS_PER_TOKEN_BOUND
from app.query import QueryStats
from app.usage import COMPUTED
from blend import ChunkKV, Prefill, hash_ids
from blend.pipeline import LayerSource
from retrieval.retriever import Hit

KVSource = Literal["exact", "blended", "computed", "fresh"]


@dataclass
class Piece:
    """One cached piece of the prompt: its tokens, the tokens it is computed after, its KV once known.
    A message piece (or the passages' turn opening) is read exact (after `context_ids`, the tokens before it
    here) or blendable (after `blend_context`, the prompt head passages are computed after)."""

    kind: Literal["head", "message", "opening", "passage"]
    ids: list[int]
    context_ids: list[int]
    kv: ChunkKV | LayerSource | None = None  # a passage's stored KV may be opened layer by layer
    tier: str | None = None  # where the KV came from; None until read, "computed" if computed here
    message: int | None = None  # a message piece: its index in QueryParams.messages
    blend_context: list[int] | None = None  # a message piece's blendable form is computed after these
    source: KVSource | None = None  # a message piece: how its KV was had (QueryStats.message_kv)
    entry_context: list[int] | None = None  # the context of the entry it read or is stored under

    def __post_init__(self) -> None:
        if self.entry_context is None:
            self.entry_context = self.context_ids

    @property
    def in_place(self) -> bool:
        """Computed (or to be) after exactly the tokens before it here, not after the head alone."""
        return self.kind != "passage" and self.entry_context == self.context_ids


@dataclass
class ChatLayout:
    """A chat's layout inputs, for remembering the exchange after the answer."""
    system: str | None
    kept: list[dict]      # the messages in the prompt as pieces, oldest first
    tools: tuple[dict, ...]
    question: dict | None  # with retrieval: the question's message (after the passages, not a piece)


@dataclass
class Plan:
    hits: list[Hit]
    pieces: list[Piece]
    suffix: list[int]   # the question (and the assistant turn's opening); fresh pieces run before it
    dropped: int
    chat: ChatLayout | None = None
    blends: bool = True  # False in mode prefix: no blendable forms are stored

    @property
    def segments(self) -> list[Piece]:
        """The pieces whose KV the prefill reads (fresh ones run with the suffix)."""
        return [p for p in self.pieces if p.source != "fresh"]

    @property
    def fresh(self) -> list[Piece]:
        return [p for p in self.pieces if p.source == "fresh"]

    @property
    def prefill_suffix(self) -> list[int]:
        return [i for p in self.fresh for i in p.ids] + self.suffix


SYSTEM_ROLES = ("system", "developer")  # their text joins the system turn (the head)


def within_chars(indexed: list[tuple[int, dict]], limit: int | None, keep: int) -> int:
    """The first message worth rendering: the older ones cannot fit a `limit`-token context on their text
    alone (no token holds more than CHARS_PER_TOKEN_BOUND characters). The last `keep` are always kept."""
    chars = 0
    for start in range(len(indexed) - 1, -1, -1):
        chars += len(message_text(indexed[start][1]))
        if limit and chars > CHARS_PER_TOKEN_BOUND * limit and start < len(indexed) - keep:
            return start + 1
    return 0


def message_text(message: dict | None) -> str:
    return ((message or {}).get("content") or "").strip()


def compute_a_short_blend_with_the_end(pieces: list[Piece]) -> None:
    """Blended messages between the exact prefix and the new end, no more tokens than the new end (a message
    repeated just before a new one: an agent's same call again): computed with the end instead. So few tokens
    are not worth the blend's selection pass and repair, and the exact prefix then runs to the end (stored so
    for the next turn)."""
    fresh = [i for i, p in enumerate(pieces) if p.source == "fresh"]
    if not fresh:
        return
    start = fresh[0]
    while start > 0 and pieces[start - 1].source == "blended" and pieces[start - 1].kind != "passage":
        start -= 1
    run = pieces[start:fresh[0]]
    before = pieces[start - 1] if start else None
    exact_before = before is None or before.source == "exact" or before.kind == "head" or (
        before.source == "computed" and before.in_place)
    if run and exact_before and sum(len(p.ids) for p in run) <= sum(len(pieces[i].ids) for i in fresh):
        for piece in run:
            piece.source, piece.kv, piece.tier, piece.entry_context = "fresh", None, None, piece.context_ids


def stored_as_prompted(piece: Piece) -> bool:
    """A message piece whose KV in this prompt is not its exact entry yet (blended, computed after the head, or
    fresh), or in mode prefix a passage computed in place."""
    if piece.kind == "passage":
        return piece.source == "fresh"
    return piece.kind != "head" and (piece.source in ("blended", "fresh") or not piece.in_place)


def span_kv(prefill: Prefill, before: list[int], ids: list[int], fingerprint: str) -> ChunkKV:
    """The KV of `ids`, right after `before` in the prefill's cache, as a piece stored after `before`."""
    start, end = len(before), len(before) + len(ids)
    keys = torch.stack([layer.keys[0, :, start:end] for layer in prefill.cache.layers]).clone()   # [L, H, T, D]
    values = torch.stack([layer.values[0, :, start:end] for layer in prefill.cache.layers]).clone()
    return ChunkKV(keys, values, torch.tensor(ids), start, hash_ids(before), fingerprint)


def fill_prefill_stats(stats: QueryStats, prefill: Prefill, mode: str, plan: Plan) -> None:
    s = prefill.stats
    stats.prompt_tokens = s.prompt_tokens
    stats.recomputed_tokens = s.recomputed_tokens
    stats.recompute_ratio = 1.0 if mode == "full" else s.ratio
    stats.fallback = s.fallback
    stats.load_wait_ms = s.load_wait_ms
    messages = [p for p in plan.pieces if p.kind == "message"]
    stats.conversation_tokens = sum(len(p.ids) for p in messages)
    stats.dropped_messages = plan.dropped
    if mode != "full":
        stats.message_kv = [p.source for p in messages]
    if mode != "full" and s.fallback is None:  # only KV read from the store counts as cached
        stored = [p for p in plan.segments if p.tier != COMPUTED]
        stats.cached_tokens = sum(len(p.ids) for p in stored)
        exact, stats.exact_tokens = s.exact_tokens, 0
        for piece in plan.segments:  # the exact prefix's pieces that came from the store
            if exact < len(piece.ids):
                break
            exact -= len(piece.ids)
            stats.exact_tokens += len(piece.ids) * (piece.tier != COMPUTED)
        stats.conversation_cached_tokens = sum(len(p.ids) for p in stored if p.kind == "message")
