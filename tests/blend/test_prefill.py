"""Selective-recompute prefill on tiny Llama / Mistral / Qwen2: the exactness guarantees."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from blend import Blender, ChunkKV, KVMismatchError, SamplingParams, StoredSpans, hash_ids
from tests.blend.conftest import generate, random_ids, tiny_model

HEAD, CHUNKS, SUFFIX = random_ids(7, 1), [random_ids(23, 2), random_ids(31, 3), random_ids(17, 4)], random_ids(9, 5)


def segments(blender: Blender, conditioned: bool = True) -> list[ChunkKV]:
    """Prompt head (exact) + chunks computed after the head (or alone from position 0)."""
    head = blender.precompute(HEAD)
    context = HEAD if conditioned else []
    return [head] + [blender.precompute(c, context, context=head if conditioned else None) for c in CHUNKS]


def prompt_ids() -> list[int]:
    return HEAD + sum(CHUNKS, []) + SUFFIX


def greedy(blender: Blender, prefill, n: int = 8) -> list[int]:
    return generate(blender, prefill, SamplingParams(max_new_tokens=n))


def test_ratio_one_reproduces_full_prefill(tiny_blender):
    full = tiny_blender.full_prefill(prompt_ids())
    blended = tiny_blender.prefill(segments(tiny_blender, conditioned=False), SUFFIX, ratio=1.0)
    assert (blended.logits - full.logits).abs().max() < 1e-3
    assert greedy(tiny_blender, blended) == greedy(tiny_blender, tiny_blender.full_prefill(prompt_ids()))


def test_full_prefill_matches_hf_forward(tiny_blender):
    ids = torch.tensor([prompt_ids()], device=tiny_blender.device)
    with torch.no_grad():
        reference = tiny_blender.model(input_ids=ids).logits[0, -1]
    assert (tiny_blender.full_prefill(prompt_ids()).logits - reference.cpu()).abs().max() < 1e-4


def test_ratio_zero_is_full_reuse_of_shifted_kv(tiny_blender):
    segs = segments(tiny_blender, conditioned=False)
    result = tiny_blender.prefill(segs, SUFFIX, ratio=0.0)
    # Reference: the shifted chunk KVs concatenated by hand, the suffix run by HF's own forward.
    keys, values, start = [], [], 0
    for seg in segs:
        keys.append(tiny_blender.shifter.shift(seg.keys, start - seg.position))
        values.append(seg.values)
        start += seg.num_tokens
    keys, values = torch.cat(keys, dim=2), torch.cat(values, dim=2)  # [L, H, cached, D]
    cache = DynamicCache(ddp_cache_data=[(k[None], v[None]) for k, v in zip(keys, values)])
    positions = torch.arange(start, start + len(SUFFIX), device=tiny_blender.device)[None]
    with torch.no_grad():
        reference = tiny_blender.model(input_ids=torch.tensor([SUFFIX], device=tiny_blender.device),
                                       position_ids=positions, cache=cache).logits
    assert (result.logits - reference[0, -1].cpu()).abs().max() < 1e-4
    for layer, (k, v) in enumerate(zip(keys, values)):
        assert torch.allclose(result.cache.layers[layer].keys[0, :, :start], k, atol=1e-5)
        assert torch.equal(result.cache.layers[layer].values[0, :, :start], v)
    assert result.stats.recomputed_tokens == 0


def test_exact_prefix_equals_prefix_caching(tiny_blender):
    """A segment left at the positions it was computed for (the prompt head) is a prefix cache."""
    head = tiny_blender.precompute(HEAD)
    for ratio in (0.0, 0.5):
        result = tiny_blender.prefill([head], SUFFIX, ratio=ratio)
        assert result.stats.exact_tokens == len(HEAD)
        assert (result.logits - tiny_blender.full_prefill(HEAD + SUFFIX).logits).abs().max() < 1e-4
    # A chunk computed right after the head and placed right after it is exact too.
    segs = segments(tiny_blender)
    assert tiny_blender.prefill(segs, SUFFIX, 0.2).stats.exact_tokens == len(HEAD) + len(CHUNKS[0])


@pytest.mark.parametrize("ratio", [0.1, 0.25, 0.5])
def test_selected_count_and_suffix_always_computed(tiny_blender, ratio):
    segs = segments(tiny_blender, conditioned=False)
    cached = sum(s.num_tokens for s in segs)
    exact = len(HEAD)  # the head sits where it was computed, with nothing before it
    result = tiny_blender.prefill(segs, SUFFIX, ratio)
    expected = round(ratio * (cached - exact))
    assert result.stats.recomputed_tokens == len(result.selected) == expected
    assert result.selected.unique().numel() == expected and result.selected.min() >= exact
    # Last layer: selected and suffix slots were rewritten, every other cached slot kept as cached.
    last = result.cache.layers[-1].values[0]                        # [H, N, D]
    cached_values = torch.cat([s.values[-1] for s in segs], dim=1)   # [H, cached, D]
    untouched = torch.ones(cached, dtype=torch.bool)
    untouched[result.selected] = False
    assert torch.equal(last[:, :cached][:, untouched], cached_values[:, untouched])
    assert not torch.equal(last[:, result.selected], cached_values[:, result.selected])
    assert (last[:, cached:].abs().sum(dim=(0, 2)) > 0).all()     # suffix computed (slots start at zero)


def test_more_recompute_moves_closer_to_full(tiny_blender):
    full = torch.log_softmax(tiny_blender.full_prefill(prompt_ids()).logits, -1)
    segs = segments(tiny_blender, conditioned=False)

    def kl(ratio: float) -> float:
        q = torch.log_softmax(tiny_blender.prefill(segs, SUFFIX, ratio).logits, -1)
        return float((full.exp() * (full - q)).sum())

    assert kl(1.0) < 1e-5
    assert kl(0.5) < kl(0.0)


def test_random_selection_is_seeded(tiny_blender):
    segs = segments(tiny_blender, conditioned=False)
    a = tiny_blender.prefill(segs, SUFFIX, 0.3, selection="random", seed=1).selected
    b = tiny_blender.prefill(segs, SUFFIX, 0.3, selection="random", seed=1).selected
    c = tiny_blender.prefill(segs, SUFFIX, 0.3, selection="hkvd").selected
    assert torch.equal(a, b) and a.numel() == c.numel()


def test_mismatched_fingerprint_or_shape_is_refused():
    blender = Blender(tiny_model("llama"), None, "tiny-llama")
    kv = blender.precompute(CHUNKS[0])
    alien = ChunkKV(kv.keys, kv.values, kv.token_ids, 0, kv.context_hash, "another-model")
    with pytest.raises(KVMismatchError, match="another-model"):
        blender.prefill([alien], SUFFIX, 0.15)
    other = Blender(tiny_model("llama", num_hidden_layers=3), None, "tiny-llama")
    with pytest.raises(KVMismatchError, match="shape"):
        other.prefill([kv], SUFFIX, 0.15)
    with pytest.raises(KVMismatchError):
        ChunkKV(kv.keys, kv.values[:, :, :3], kv.token_ids, 0, kv.context_hash, kv.fingerprint)
    with pytest.raises(ValueError, match="ratio"):
        blender.prefill([kv], SUFFIX, 1.5)


def test_context_kv_must_match_context_ids():
    blender = Blender(tiny_model("llama"), None, "tiny-llama")
    head = blender.precompute(HEAD)
    with pytest.raises(KVMismatchError):
        blender.precompute(CHUNKS[0], CHUNKS[1][: len(HEAD)], context=head)
    via_kv = blender.precompute(CHUNKS[0], HEAD, context=head)
    direct = blender.precompute(CHUNKS[0], HEAD)
    assert via_kv.context_hash == direct.context_hash == hash_ids(HEAD) and via_kv.position == len(HEAD)
    assert torch.allclose(via_kv.keys, direct.keys, atol=1e-5)


@pytest.mark.parametrize("temperature", [4.05e-184, 1e-30, 1e-6])
def test_a_vanishing_temperature_samples_greedily(temperature):
    from blend.decode import sample_next

    logits = torch.tensor([1.0, 30.0, -5.0, 29.9])
    params = SamplingParams(temperature=temperature)
    assert [sample_next(logits, params, torch.Generator().manual_seed(s)) for s in range(5)] == [1] * 5


@pytest.mark.parametrize("ratio", [0.0, 0.3])
def test_a_fresh_span_between_cached_ones_is_computed_in_the_prefill(tiny_blender, ratio):
    """A span with no KV between cached chunks runs through every layer in the prefill: with every chunk fresh
    it is the full prefill; with one fresh, its KV is what the model computes there given the layout."""
    head = tiny_blender.precompute(HEAD)
    start = len(HEAD)
    fresh = []
    for chunk in CHUNKS:
        fresh.append(tiny_blender.fresh(chunk, start))
        start += len(chunk)
    all_fresh = tiny_blender.prefill([head, *fresh], SUFFIX, ratio=ratio)
    full = tiny_blender.full_prefill(prompt_ids())
    assert (all_fresh.logits - full.logits).abs().max() < 1e-3
    assert all_fresh.stats.cached_tokens == len(HEAD) and sorted(all_fresh.selected.tolist()) == list(
        range(len(HEAD), start))

    segs = segments(tiny_blender)  # head + chunks computed after the head: the middle one left without KV
    middle = tiny_blender.fresh(CHUNKS[1], len(HEAD) + len(CHUNKS[0]))
    mixed = tiny_blender.prefill([segs[0], segs[1], middle, segs[3]], SUFFIX, ratio=ratio)
    lo, hi = middle.position, middle.position + len(CHUNKS[1])
    assert set(range(lo, hi)) <= set(mixed.selected.tolist())
    # its KV at layer 0 is exactly the model's (layer 0 sees only exact K/V before it: head + chunk 0, computed
    # in place): the full prefill's
    assert torch.allclose(mixed.cache.layers[0].keys[0, :, lo:hi], full.cache.layers[0].keys[0, :, lo:hi], atol=1e-4)
    assert mixed.stats.cached_tokens == len(HEAD) + len(CHUNKS[0]) + len(CHUNKS[2])


def fp16_round_trip(keys: torch.Tensor, values: torch.Tensor, spans: list[tuple[int, int]]) -> None:
    """A lossy store codec's read of spans of one layer's K/V [1, H, N, D] (fp16's rounding, in the model's dtype)."""
    for start, end in spans:
        for x in (keys, values):
            x[:, :, start:end] = x[:, :, start:end].half().to(x.dtype)


@pytest.mark.parametrize("ratio, chunk_tokens", [(0.0, None), (0.3, None), (0.3, 8)])
def test_a_prompt_computed_answers_as_its_repeat_that_reads_the_stored_spans(tiny_blender, ratio, chunk_tokens,
                                                                              monkeypatch):
    """The spans the store will keep, computed in a prefill (fresh, or read and blended; a layer in one chunk or
    in chunks of 8 rows that cut spans), are attended to as their round trip: the prompt again, its spans read
    back exact through the codec and only the question computed, gives the first prefill's logits, where
    attending to the unrounded K/V would not."""
    monkeypatch.setattr(tiny_blender, "chunk_tokens", chunk_tokens)
    head = tiny_blender.precompute(HEAD)
    blended = tiny_blender.precompute(CHUNKS[2], [], context=None)  # read, and repaired at `ratio`
    segs = [head, tiny_blender.fresh(CHUNKS[0], len(HEAD)), tiny_blender.fresh(CHUNKS[1], len(HEAD) + 23),
            blended]  # computed at 0, read at len(HEAD) + 54
    spans = ((len(HEAD), len(HEAD) + 23), (len(HEAD) + 23, len(HEAD) + 54), (len(HEAD) + 54, len(HEAD) + 71))
    stored = StoredSpans(spans, fp16_round_trip)
    first = tiny_blender.prefill(segs, SUFFIX, ratio=ratio, stored=stored)
    unrounded = tiny_blender.prefill(segs, SUFFIX, ratio=ratio)
    ids = HEAD + sum(CHUNKS, [])
    kept = [head] + [ChunkKV(torch.stack([layer.keys[0, :, a:b] for layer in first.cache.layers]),
                             torch.stack([layer.values[0, :, a:b] for layer in first.cache.layers]),
                             torch.tensor(ids[a:b]), a, hash_ids(ids[:a]), head.fingerprint) for a, b in spans]
    for kv in kept[1:]:  # what the prefill attended to is already its round trip: storing it changes nothing
        assert torch.equal(kv.keys, kv.keys.half().to(kv.keys.dtype))
    repeat = tiny_blender.prefill(kept, SUFFIX, ratio=ratio)
    assert repeat.stats.exact_tokens == len(ids)  # every span read exact: only the question computed
    gap, unrounded_gap = ((p.logits - repeat.logits).abs().max() for p in (first, unrounded))
    assert gap < 1e-5 < unrounded_gap / 10, (gap, unrounded_gap)

