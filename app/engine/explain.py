"""What blending did to one prompt, token by token: the `explain` part of a /v1/query response.

The prompt is laid out head | passage … | question; each token gets its text, the piece it belongs
to, the selection score it got at the check layer and whether it was recomputed. Built only when
a request asks for it, after the answer, and capped at `limits.max_explain_tokens` tokens.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, Field

from blend import Prefill


class ExplainChunk(BaseModel):
    kind: Literal["head", "passage", "question"] = Field(
        description="head: the fixed prompt opening; passage: a retrieved chunk; question: the suffix, always "
                    "computed fresh.")
    start: int = Field(description="First token position (inclusive).")
    end: int = Field(description="Last token position (exclusive).")
    source: int | None = Field(None, description="For a passage: its index in the response's `sources`.")
    recomputed: int = Field(description="Tokens of this piece recomputed after the check layer.")


class ExplainToken(BaseModel):
    text: str = Field(description="The token decoded on its own (a split multi-byte character shows as U+FFFD).")
    chunk: int = Field(description="Index of its piece in `chunks`.")
    score: float | None = Field(description="Its selection score; null where nothing was scored (the exact "
                                            "prefix, the question, full reuse, full prefill).")
    selected: bool = Field(description="Recomputed after the check layer (a cached token whose K/V were refreshed).")


class Explain(BaseModel):
    """Which prompt tokens blending recomputed, and why (their scores)."""

    score: str = Field(description="What `tokens[].score` measures.")
    prompt_tokens: int = Field(description="Tokens in the whole prompt.")
    exact_tokens: int = Field(description="Leading tokens whose cached K/V are exact (a prefix cache): positions "
                                          "[0, exact_tokens).")
    cached_tokens: int = Field(description="Tokens whose K/V came from the store: positions [0, cached_tokens).")
    selected_tokens: int = Field(description="Cached tokens recomputed, over the whole prompt (= stats."
                                             "recomputed_tokens), even when `tokens` is truncated.")
    truncated: bool = Field(description="True when `tokens` holds only the first `max_tokens` of the prompt.")
    max_tokens: int = Field(description="The server's cap on `tokens` (limits.max_explain_tokens).")
    chunks: list[ExplainChunk]
    tokens: list[ExplainToken]


def explain_prompt(tokenizer, head: Sequence[int], passages: Sequence[Sequence[int]], question: Sequence[int],
                   prefill: Prefill, *, score: str, max_tokens: int) -> Explain:
    """The Explain of a prefill over head | passages | question (in that order, as the engine lays them out)."""
    pieces = [("head", head, None), *(("passage", p, i) for i, p in enumerate(passages)),
              ("question", question, None)]
    selected = set(prefill.selected.tolist())
    chunks, chunk_of, start = [], [], 0
    for index, (kind, ids, source) in enumerate(pieces):
        end = start + len(ids)
        chunks.append(ExplainChunk(kind=kind, start=start, end=end, source=source,
                                   recomputed=sum(start <= p < end for p in selected)))
        chunk_of += [index] * len(ids)
        start = end
    ids = [i for _, piece, _ in pieces for i in piece][:max_tokens]
    scores = prefill.scores.tolist() if prefill.scores is not None else [math.nan] * prefill.num_tokens
    texts = tokenizer.batch_decode([[i] for i in ids])
    tokens = [ExplainToken(text=text, chunk=chunk_of[p], score=_rounded(scores[p]), selected=p in selected)
              for p, text in enumerate(texts)]
    s = prefill.stats
    return Explain(score=score, prompt_tokens=s.prompt_tokens, exact_tokens=s.exact_tokens,
                   cached_tokens=s.cached_tokens, selected_tokens=len(selected),
                   truncated=s.prompt_tokens > max_tokens, max_tokens=max_tokens, chunks=chunks, tokens=tokens)


def _rounded(score: float) -> float | None:
    return None if math.isnan(score) else float(f"{score:.4g}")
