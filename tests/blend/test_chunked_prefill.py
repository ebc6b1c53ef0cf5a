"""Chunked prefill (Blender.chunk_tokens): a layer run a chunk of its tokens at a time gives the same prefill as the
layer in one piece, within float32 rounding (1e-4, this suite's bound for exact equalities): full compute,
blends with every selection policy (the check layer's deviations and the question's attention gathered over the
chunks), fresh spans, and the model's own forward a model the loop refuses runs. A slice is one chunk."""
from __future__ import annotations

import pytest
import torch

from blend import Blender
from tests.blend.conftest import ARCHS, random_ids, tiny_model
from tests.blend.test_prefill import CHUNKS, HEAD, SUFFIX, prompt_ids, segments

EXACT = 1e-4


@pytest.fixture(scope="module", params=sorted(ARCHS))
def tiny_blender(request) -> Blender:
    """One blender per architecture for the module (chunk_tokens is set per prefill, then put back)."""
    return Blender(tiny_model(request.param), tokenizer=None, fingerprint=f"tiny-{request.param}")


def steps(blender: Blender, chunk_tokens: int | None, *args, **options):
    """(the prefill, how many slices it yielded) with the blender's layers cut into chunks of chunk_tokens."""
    blender.chunk_tokens = chunk_tokens
    try:
        run, slices = blender.prefill_steps(*args, **options), 0
        while True:
            try:
                next(run)
                slices += 1
            except StopIteration as done:
                return done.value, slices
    finally:
        blender.chunk_tokens = None


def assert_same(chunked, whole) -> None:
    assert (chunked.logits - whole.logits).abs().max() < EXACT
    assert torch.equal(chunked.selected, whole.selected)
    for a, b in zip(chunked.cache.layers, whole.cache.layers):
        assert torch.allclose(a.keys, b.keys, atol=EXACT) and torch.allclose(a.values, b.values, atol=EXACT)


@pytest.mark.parametrize("chunk_tokens", [1, 8, 29])
def test_full_compute_in_chunks_is_the_prefill_in_one_piece(tiny_blender, chunk_tokens):
    ids = prompt_ids()                                       # 87 tokens, no KV: every token runs every layer
    whole, layer_slices = steps(tiny_blender, None, [], ids, 1.0)
    chunked, slices = steps(tiny_blender, chunk_tokens, [], ids, 1.0)
    assert_same(chunked, whole)
    layers = tiny_blender.num_layers
    assert layer_slices == layers and slices == layers * -(-len(ids) // chunk_tokens)
    assert (chunked.logits - tiny_blender.full_prefill(ids).logits).abs().max() < 1e-3   # as blend@1 is


@pytest.mark.parametrize("selection", ["query", "hkvd", "hybrid", "random"])
def test_a_blend_in_chunks_selects_and_computes_what_it_does_in_one_piece(tiny_blender, selection):
    """Chunks of 4: the 9-token question pass is cut in three (its attention summed over them), the check
    layer's pass over every candidate in many (its deviations gathered in order)."""
    segs = segments(tiny_blender, conditioned=False)
    whole, _ = steps(tiny_blender, None, segs, SUFFIX, 0.3, selection=selection)
    chunked, _ = steps(tiny_blender, 4, segs, SUFFIX, 0.3, selection=selection)
    assert whole.stats.recomputed_tokens > 0
    assert_same(chunked, whole)
    assert torch.allclose(chunked.scores, whole.scores, atol=EXACT, equal_nan=True)


@pytest.mark.parametrize("ratio", [0.0, 0.3])
def test_fresh_spans_in_chunks(tiny_blender, ratio):
    segs = segments(tiny_blender)
    middle = tiny_blender.fresh(CHUNKS[1], len(HEAD) + len(CHUNKS[0]))  # a span with no KV between cached ones
    layout = [segs[0], segs[1], middle, segs[3]]
    whole, _ = steps(tiny_blender, None, layout, SUFFIX, ratio)
    chunked, _ = steps(tiny_blender, 5, layout, SUFFIX, ratio)
    assert_same(chunked, whole)


def test_a_refused_prompt_runs_the_models_own_forward_in_chunks():
    """A prompt past Mistral's sliding window is not blended: the model's own forward runs it, a chunk of tokens
    per slice through the cache, as exact as the forward in one piece."""
    blender = Blender(tiny_model("mistral", sliding_window=32), tokenizer=None, fingerprint="tiny-mistral-window")
    ids = random_ids(90, 7)
    chunked, slices = steps(blender, 16, [], ids, 1.0)
    assert chunked.stats.fallback and "sliding window" in chunked.stats.fallback
    assert slices == -(-len(ids) // 16)
    assert (chunked.logits - blender.full_prefill(ids).logits).abs().max() < EXACT
    assert chunked.cache.layers[0].keys.shape[2] == len(ids)


def test_chunk_tokens_must_be_positive():
    with pytest.raises(ValueError, match="chunk_tokens"):
        Blender(tiny_model("llama"), tokenizer=None, fingerprint="tiny-llama", chunk_tokens=0)


@pytest.mark.parametrize("selection", ["query", "hkvd"])
def test_chunks_on_the_flex_backend_are_the_cpus_whole_layers(selection):
    """The GPU backend's plans (FlexAttention block masks over a chunk's positions, keys up to the prompt's end),
    run eagerly on the host: a chunked blend and a chunked full compute equal the CPU's in one piece."""
    from blend.backend import CudaBackend
    from tests.blend.conftest import TEST_DEVICE

    blender = Blender(tiny_model("llama"), tokenizer=None, fingerprint="tiny-llama")
    segs = segments(blender, conditioned=False)
    blended, full = blender.prefill(segs, SUFFIX, 0.3, selection=selection), blender.prefill([], prompt_ids(), 1.0)
    blender.backend = CudaBackend(TEST_DEVICE)
    assert_same(steps(blender, 16, segs, SUFFIX, 0.3, selection=selection)[0], blended)
    assert_same(steps(blender, 16, [], prompt_ids(), 1.0)[0], full)
