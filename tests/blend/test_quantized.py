"""Quantised linears (blend.quantized, model.weights int8 | int4) on tiny Llama: the kernel's product is the
dequantised weights' and each row's alone; a GGUF-form weight comes back exactly; a decode step reads the codes;
the quantised model keeps every exactness rule against its own forward (full and blended prefill, decode through
the kernel step and the model's layers, a repeat that reads its stored spans); the fingerprint keys the setting."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
from torch.nn import functional as F

from blend import Blender, cpu_kernels
from blend.kernel_step import KernelStep
from blend.model import model_fingerprint
from blend.quantized import QGROUP, QuantizedLinear, dequantize, quantize, quantize_linears
from tests.blend import test_batch_decode, test_kernel_step, test_prefill
from tests.blend.conftest import TEST_DEVICE, tiny_model
from tests.helpers import shared_tokenizer

pytestmark = [pytest.mark.skipif(TEST_DEVICE.type != "cpu", reason="the CPU kernels"),
              pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")]


@pytest.fixture(params=["int8", "int4"])
def quantized_blender(request) -> Blender:
    model = tiny_model("llama")
    assert quantize_linears(model, request.param) == 4 * 7 + 1  # every layer's linears and the LM head
    return Blender(model, tokenizer=None, fingerprint=f"tiny-llama-{request.param}")


def gguf_like(out: int, features: int, bits: int) -> torch.Tensor:
    """Weights as a Q8_0 / Q4_1 block dequantises them: every group spans its whole code range."""
    generator = torch.Generator().manual_seed(bits)
    groups = features // QGROUP
    scale = torch.rand(out, groups, 1, generator=generator) / 50 + 1e-3
    if bits == 8:
        q = torch.randint(-127, 128, (out, groups, QGROUP), generator=generator)
        q[..., 0] = 127
        return (q.float() * scale).reshape(out, features)
    q = torch.randint(0, 16, (out, groups, QGROUP), generator=generator)
    q[..., 0], q[..., 1] = 0, 15
    low = torch.randn(out, groups, 1, generator=generator) / 10
    return (q.float() * scale + low).reshape(out, features)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_gguf_form_weight_comes_back_exactly_and_any_weight_within_half_a_step(bits):
    exact = gguf_like(48, 96, bits)
    assert torch.allclose(dequantize(*quantize(exact, bits)), exact, rtol=0, atol=1e-6)
    weight = torch.randn(48, 96)
    codes, scales, mins = quantize(weight, bits)
    error = (dequantize(codes, scales, mins) - weight).abs().reshape(48, -1, QGROUP)
    assert (error <= scales[..., None] / 2 + 1e-6).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_rows_are_the_dequantised_product_and_each_row_alone(bits):
    assert cpu_kernels.load() is not None, cpu_kernels.unavailable()
    forms = [quantize(torch.randn(out, 96), bits) for out in (40, 24)]
    weights = torch.cat([dequantize(*form) for form in forms])                       # [64, 96]
    codes, scales, mins = ([form[part] for form in forms] for part in range(3))
    mins = mins if bits == 4 else []
    x = torch.randn(cpu_kernels.LINEAR_ROWS, 96)
    together = cpu_kernels.quantized_rows(x, codes, scales, mins)                    # [8, 64]
    assert torch.allclose(together, F.linear(x, weights), atol=1e-4, rtol=1e-5)
    for rows in range(1, cpu_kernels.LINEAR_ROWS):
        assert torch.equal(cpu_kernels.quantized_rows(x[:rows], codes, scales, mins), together[:rows])
    with pytest.raises(ValueError, match="quantised linear rows take"):
        cpu_kernels.quantized_rows(torch.randn(2, 80), codes, scales, mins)          # not whole groups


@torch.inference_mode()
def test_a_decode_step_reads_the_codes_and_a_prefill_the_float_copy(quantized_blender):
    """The float32 weight is the codes dequantised; spoiling it moves many rows' product, not a few rows'."""
    linear = quantized_blender.model.model.layers[0].mlp.down_proj
    assert isinstance(linear, QuantizedLinear) and linear.kernel
    assert torch.equal(linear.weight, dequantize(linear.codes, linear.scales, linear.mins))
    few, many = torch.randn(1, 3, linear.in_features), torch.randn(1, 40, linear.in_features)
    before_few, before_many = linear(few), linear(many)
    linear.weight.add_(1.0)
    assert torch.equal(linear(few), before_few)
    assert not torch.allclose(linear(many), before_many)


def test_the_quantised_models_prefills_are_its_own_forward(quantized_blender):
    test_prefill.test_full_prefill_matches_hf_forward(quantized_blender)
    test_prefill.test_ratio_one_reproduces_full_prefill(quantized_blender)


def test_the_quantised_models_decode_is_its_own_forward(quantized_blender):
    """Greedy tokens as HF's forward over its own cache, through the kernel step (its probe passed) and through
    the model's layers."""
    test_batch_decode.test_alone_matches_hf_forward(quantized_blender)
    test_kernel_step.test_the_kernel_step_computes_what_the_models_layers_compute(quantized_blender)


@pytest.mark.parametrize("ratio", [0.0, 0.3])
def test_the_quantised_model_answers_a_repeat_from_its_stored_spans_as_computed(quantized_blender, ratio,
                                                                                 monkeypatch):
    test_prefill.test_a_prompt_computed_answers_as_its_repeat_that_reads_the_stored_spans(
        quantized_blender, ratio, None, monkeypatch)


def test_the_kernel_step_reads_the_codes_not_their_float_copy():
    """The decode step's layers stream the codes: with every layer's float weights zeroed its logits stay the same
    bits; with one layer's codes changed they move."""
    model = tiny_model("llama")
    quantize_linears(model, "int4")
    step, reason = KernelStep.for_model(Blender(model, tokenizer=None, fingerprint="tiny").model)
    assert reason is None
    pool = test_kernel_step.filled_pools(Blender(model, tokenizer=None, fingerprint="tiny"), [step.pool_dtype])[0]
    tokens, positions = torch.tensor([5, 9, 3]), torch.tensor(test_kernel_step.LENGTHS)
    with torch.inference_mode():
        before = step.logits(pool, tokens, positions, 64)
        for layer in model.model.layers:
            for linear in layer.modules():
                if isinstance(linear, QuantizedLinear):
                    linear.weight.zero_()
        assert torch.equal(step.logits(pool, tokens, positions, 64), before)
        model.model.layers[1].mlp.down_proj.codes.zero_()
        assert not torch.allclose(step.logits(pool, tokens, positions, 64), before)


def test_the_fingerprint_keys_the_weight_setting():
    """KV computed under one setting is never read under another: each setting its own fingerprint, even where
    the quantised weights are the float32 ones exactly (a GGUF-form model's int4)."""
    tokenizer = shared_tokenizer()
    prints = {}
    for weights in ("float32", "int8", "int4"):
        model = tiny_model("llama")
        with torch.no_grad():   # GGUF-form weights: int4 gives them back exactly
            for name, linear in model.named_modules():
                if isinstance(linear, torch.nn.Linear) and name != "lm_head":
                    linear.weight.copy_(gguf_like(*linear.weight.shape, 4))
        before = {name: p.clone() for name, p in model.named_parameters()}
        quantize_linears(model, weights)
        if weights == "int4":
            assert all(torch.allclose(p, before[name], rtol=0, atol=1e-6) for name, p in model.named_parameters()
                       if "lm_head" not in name and "embed" not in name)
        prints[weights] = model_fingerprint(model, tokenizer, weights)
    assert len(set(prints.values())) == 3
    with pytest.raises(ValueError, match="model.weights must be one of"):
        quantize_linears(tiny_model("llama"), "int3")
