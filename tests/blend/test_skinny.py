"""SkinnyLinear: the decode steps' matmul form gives F.linear's results, for any row count and shape."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from blend import Blender, DecodeRuntime
from blend.skinny import SKINNY_ROWS, SkinnyLinear, use_skinny_linears
from tests.blend.conftest import tiny_model


@pytest.mark.parametrize("bias", [False, True])
def test_equals_f_linear_for_every_row_count(bias):
    torch.manual_seed(0)
    layer = nn.Linear(48, 80, bias=bias)
    weight, bias_tensor = layer.weight.detach().clone(), None if layer.bias is None else layer.bias.detach().clone()
    use_skinny_linears(layer)
    assert type(layer) is SkinnyLinear
    for shape in [(1, 48), (1, 1, 48), (2, 1, 48), (3, 1, 48), (2, 5, 48), (SKINNY_ROWS + 1, 48), (4, 9, 48),
                  (1, 300, 48)]:
        x = torch.randn(shape)
        got = layer(x)
        assert got.shape == (*shape[:-1], 80) and got.is_contiguous()
        torch.testing.assert_close(got, F.linear(x, weight, bias_tensor), rtol=1e-5, atol=1e-5)


def test_switches_only_plain_linears_and_keeps_the_weights():
    model = tiny_model("llama")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    plain = sum(type(m) is nn.Linear for m in model.modules())
    assert use_skinny_linears(model) == plain > 0
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert type(model.model.embed_tokens) is nn.Embedding


def test_a_cpu_blender_uses_them_and_still_matches_the_model():
    """The Blender switches a CPU model; its decode steps still give the model's own next token."""
    model = tiny_model("llama")
    blender = Blender(model, tokenizer=None, fingerprint="tiny")
    if blender.device.type != "cpu":
        pytest.skip("SkinnyLinear is for the CPU")
    assert any(type(m) is SkinnyLinear for m in model.modules())
    ids = list(range(3, 40))
    decoder = DecodeRuntime(blender, slots=1, max_len=256)
    sequence = decoder.start(blender.full_prefill(ids[:-1]))  # a decode pool slot (blend.pool)
    try:
        token = decoder.step([sequence], [ids[-1]], [len(ids) - 1])[0]  # greedy: a token, not logits
    finally:
        sequence.release()
    assert token == int(blender.full_prefill(ids).logits.argmax())
