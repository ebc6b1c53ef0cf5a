"""Prefill.scores: each cached non-exact token's selection score, NaN where nothing was scored."""
from __future__ import annotations

import torch

from tests.blend.test_prefill import CHUNKS, HEAD, SUFFIX, prompt_ids, segments


def test_scores_cover_exactly_the_scored_tokens_and_select_the_top(tiny_blender):
    result = tiny_blender.prefill(segments(tiny_blender), SUFFIX, ratio=0.25)
    scores, exact, cached = result.scores, result.stats.exact_tokens, result.stats.cached_tokens
    assert scores.shape == (result.num_tokens,) and exact == len(HEAD) + len(CHUNKS[0])  # head + first chunk
    assert scores[:exact].isnan().all() and scores[cached:].isnan().all()   # exact prefix, question
    assert scores[exact:cached].isfinite().all() and (scores[exact:cached] >= 0).all()
    # HKVD: every recomputed token scores at least as high as every token left cached.
    chosen = torch.zeros(result.num_tokens, dtype=torch.bool)
    chosen[result.selected] = True
    scored = ~scores.isnan()
    assert scores[chosen].min() >= scores[scored & ~chosen].max()


def test_nothing_is_scored_without_a_check(tiny_blender):
    for result in (tiny_blender.prefill(segments(tiny_blender), SUFFIX, ratio=0.0),
                   tiny_blender.full_prefill(prompt_ids())):
        assert result.scores.shape == (result.num_tokens,) and result.scores.isnan().all()
