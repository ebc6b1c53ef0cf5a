"""Model loading and the fingerprint the store keys on."""
from __future__ import annotations

import time

import pytest
import torch

from blend import load_model
from blend.model import model_fingerprint
from tests.blend.conftest import tiny_model
from tests.conftest import MODEL_CACHE


@pytest.fixture(scope="module")
def tokenizer(smollm):
    return smollm.tokenizer


def test_fingerprint_is_stable_and_tracks_config_and_weights(tokenizer):
    a, b = tiny_model("llama"), tiny_model("llama")
    assert model_fingerprint(a, tokenizer) == model_fingerprint(b, tokenizer)
    assert model_fingerprint(tiny_model("llama", num_hidden_layers=3), tokenizer) != model_fingerprint(a, tokenizer)
    assert model_fingerprint(tiny_model("qwen2"), tokenizer) != model_fingerprint(a, tokenizer)
    with torch.no_grad():
        b.model.layers[0].mlp.down_proj.weight.add_(0.01)
    assert model_fingerprint(b, tokenizer) != model_fingerprint(a, tokenizer)


def test_embedded_model_loads_from_cache_fast_with_a_stable_fingerprint(smollm):
    start = time.perf_counter()
    again = load_model("embedded", cache_dir=MODEL_CACHE)
    seconds = time.perf_counter() - start
    print(f"embedded model loaded from cache in {seconds:.2f}s")  # goal < 5 s; a speed goal, not asserted
    assert again.fingerprint == smollm.fingerprint
    assert again.model.config.num_hidden_layers == 30 and again.model.config.num_key_value_heads == 3
