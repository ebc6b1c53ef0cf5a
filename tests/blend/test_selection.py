"""Selection policies on tiny Llama / Mistral / Qwen2: counts, scores, exactness, config errors."""
from __future__ import annotations

import math

import pytest
import torch

from blend import Blender
from blend.selection import POLICIES, Policy, SelectionContext, get_policy, ranks, select
from tests.blend.conftest import tiny_model
from tests.blend.test_prefill import CHUNKS, HEAD, SUFFIX, greedy, prompt_ids, segments


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("ratio", [0.1, 0.3, 0.5])
def test_every_policy_selects_exactly_its_share_plus_the_question(tiny_blender, policy, ratio):
    segs = segments(tiny_blender)  # head + first chunk exact, the other chunks are candidates
    exact, cached = len(HEAD) + len(CHUNKS[0]), sum(s.num_tokens for s in segs)
    result = tiny_blender.prefill(segs, SUFFIX, ratio, selection=policy)
    expected = round(ratio * (cached - exact))
    assert result.stats.recomputed_tokens == len(result.selected) == expected
    assert result.selected.unique().numel() == expected
    assert exact <= int(result.selected.min()) and int(result.selected.max()) < cached
    # Scores: one per candidate, NaN elsewhere; the selected tokens are the top scores.
    assert result.scores.shape == (len(prompt_ids()),)
    assert result.scores[:exact].isnan().all() and result.scores[cached:].isnan().all()
    candidate = result.scores[exact:cached]
    assert not candidate.isnan().any()
    threshold = candidate.sort(descending=True).values[expected - 1]
    assert (result.scores[result.selected] >= threshold).all()
    # The suffix ran through the last layer (its slots start at zero).
    assert (result.cache.layers[-1].values[0, :, cached:].abs().sum(dim=(0, 2)) > 0).all()


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_ratio_one_is_full_prefill_and_zero_is_reuse_for_every_policy(tiny_blender, policy):
    segs = segments(tiny_blender, conditioned=False)
    full = tiny_blender.full_prefill(prompt_ids())
    blended = tiny_blender.prefill(segs, SUFFIX, 1.0, selection=policy)
    assert (blended.logits - full.logits).abs().max() < 1e-3
    assert greedy(tiny_blender, blended) == greedy(tiny_blender, tiny_blender.full_prefill(prompt_ids()))
    reuse = tiny_blender.prefill(segs, SUFFIX, 0.0, selection=policy)
    assert torch.equal(reuse.logits, tiny_blender.prefill(segs, SUFFIX, 0.0, selection="hkvd").logits)
    assert reuse.stats.recomputed_tokens == 0 and reuse.scores.isnan().all()


def test_policies_rank_by_what_they_read(tiny_blender):
    """hkvd picks the largest deviations; query the tokens the question attends to most."""
    segs = segments(tiny_blender)
    seen: dict[str, SelectionContext] = {}

    def spy(name: str) -> Policy:
        inner = get_policy(name)
        return Policy(f"spy-{name}", lambda ctx: (seen.setdefault(name, ctx), inner.score(ctx))[1],
                      inner.deviation, inner.question_layers)

    hkvd = tiny_blender.prefill(segs, SUFFIX, 0.25, selection=spy("hkvd"))
    ctx = seen["hkvd"]
    assert torch.equal(hkvd.selected - ctx.exact, ctx.deviation.topk(ctx.count).indices.sort().values)
    query = tiny_blender.prefill(segs, SUFFIX, 0.25, selection=spy("query"))
    ctx = seen["query"]
    # The recorded attention is a distribution over the prompt: its share on the candidates is at most 1.
    assert sorted(ctx.attention) == list(get_policy("query").layer_range(tiny_blender.num_layers))
    for layer, attention in ctx.attention.items():
        assert attention.shape == (4, ctx.n) and (attention.sum(-1) <= 1 + 1e-5).all(), layer  # 4 query heads
        assert (attention.sum(-1) > 0).all()
    assert ctx.deviation is None  # query reads no deviation, so no layer ran full width
    assert torch.equal(query.selected, select(get_policy("query"), ctx)[0] + ctx.exact)


def test_random_policy_is_seeded():
    blender = Blender(tiny_model("llama"), None, "tiny-llama")
    segs = segments(blender)
    a = blender.prefill(segs, SUFFIX, 0.3, selection="random", seed=1).selected
    assert torch.equal(a, blender.prefill(segs, SUFFIX, 0.3, selection="random", seed=1).selected)
    assert not torch.equal(a, blender.prefill(segs, SUFFIX, 0.3, selection="random", seed=2).selected)


def test_unknown_policy_and_bad_check_layer_are_refused():
    model = tiny_model("llama")  # 4 layers: the check layer may be 0..2
    with pytest.raises(ValueError, match="unknown selection policy 'nope'.*hkvd"):
        Blender(model, None, "tiny", selection="nope")
    for layer in (-1, 3, 4):
        with pytest.raises(ValueError, match=r"check_layer must be in \[0, 2\]"):
            Blender(model, None, "tiny", check_layer=layer)
    blender = Blender(model, None, "tiny", check_layer=2)
    result = blender.prefill(segments(blender), SUFFIX, 0.3)
    assert result.stats.recomputed_tokens == round(0.3 * sum(map(len, CHUNKS[1:])))
    with pytest.raises(ValueError, match="unknown selection policy"):
        blender.prefill(segments(blender), SUFFIX, 0.3, selection="nope")


def test_ranks_are_scale_free():
    x = torch.tensor([3.0, -1.0, 10.0, 0.5])
    assert torch.equal(ranks(x), torch.tensor([2 / 3, 0.0, 1.0, 1 / 3]))
    assert torch.equal(ranks(x * 100 + 7), ranks(x))
    assert not math.isnan(float(ranks(torch.tensor([1.0])).sum()))
