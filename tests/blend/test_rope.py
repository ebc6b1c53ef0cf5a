"""RoPE shift: exact, follows the model's own rotary embedding, refuses what it cannot shift."""
from __future__ import annotations

import pytest
import torch

from blend import Blender, RopeShifter, RopeUnsupportedError
from tests.blend.conftest import random_ids, tiny_model

IDS = random_ids(40, 11)


def test_shift_then_unshift_returns_keys(tiny_blender):
    keys = tiny_blender.precompute(IDS).keys
    back = tiny_blender.shifter.shift(tiny_blender.shifter.shift(keys, 1234), -1234)
    assert torch.allclose(back, keys, atol=1e-5)


@pytest.mark.parametrize("rope", [None, {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                                  {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 128,
                                   "rope_theta": 500000.0}])
@pytest.mark.parametrize("delta", [1, 37, 700])
def test_layer0_keys_shifted_equal_fresh_keys_at_new_positions(rope, delta):
    # Layer-0 keys depend only on the token and its position, so a shifted chunk must match
    # the same chunk computed fresh `delta` positions later.
    overrides = {"rope_parameters": rope} if rope else {}
    blender = Blender(tiny_model("llama", **overrides), None, "tiny")
    at_zero = blender.precompute(IDS)
    later = blender.precompute(IDS, random_ids(delta, 12))
    assert later.position == delta
    shifted = blender.shifter.shift(at_zero.keys[0], delta)
    assert torch.allclose(shifted, later.keys[0], atol=1e-4)
    assert not torch.allclose(at_zero.keys[0], later.keys[0], atol=1e-3)


def test_dynamic_ntk_falls_back_to_full_prefill():
    model = tiny_model("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(RopeUnsupportedError, match="dynamic"):
        RopeShifter(model)
    blender = Blender(model, None, "tiny")
    kv = blender.precompute(IDS)
    result = blender.prefill([kv], [5, 6, 7], ratio=0.15)
    assert result.stats.fallback and "dynamic" in result.stats.fallback
    assert (result.logits - blender.full_prefill(IDS + [5, 6, 7]).logits).abs().max() < 1e-4


def test_partial_rotary_is_refused():
    model = tiny_model("llama")
    model.model.rotary_emb.inv_freq = model.model.rotary_emb.inv_freq[:4]  # rotates 8 of 16 dims
    with pytest.raises(RopeUnsupportedError, match="partial"):
        RopeShifter(model)
