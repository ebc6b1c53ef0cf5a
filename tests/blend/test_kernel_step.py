"""The kernel step (blend.kernel_step): Llama-shaped layers decode on the CPU kernels as the model's own layers do
(logits and the K/V written into the pool, rows of different lengths, a padding row), held to the model's own
forward by its probe (blend.gate.judge's tolerance, the same top token); a model whose layers are not Llama's
shape, that has a sliding window, or whose math the step would not reproduce, decodes through its layers
(blend.batch.LayerStep), with the reason, and still gives the model's own tokens."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from blend import BLEND_ATTENTION, Blender, DecodeRuntime, SamplingParams
from blend.batch import LayerStep
from blend.kernel_step import KernelStep, projection_weights
from blend.pool import KVPool
from blend.quantized import quantize_linears
from tests.blend.conftest import TEST_DEVICE, TINY, random_ids, runtime, tiny_model
from tests.blend.test_batch_decode import hf_greedy

pytestmark = [pytest.mark.skipif(TEST_DEVICE.type != "cpu", reason="the CPU kernels"),
              pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")]

LENGTHS = [17, 40, 5]  # rows' cached tokens; a fourth row pads


def filled_pools(blender: Blender, dtypes: list[torch.dtype]) -> list[KVPool]:
    """A pool of each dtype, all holding the same random K/V (float16 values) for LENGTHS in slots 0..2."""
    pools = [KVPool(blender.num_layers, blender.kv_heads, blender.head_dim, slots=4, max_len=200,
                    dtype=dtype, device="cpu") for dtype in dtypes]
    generator = torch.Generator().manual_seed(0)
    for pool in pools:
        pool.readable(4, pool.columns)
    for slot, length in enumerate(LENGTHS):
        shape = (1, blender.kv_heads, length, blender.head_dim)
        layers = [tuple(torch.randn(shape, generator=generator).half().float() for _ in range(2))
                  for _ in range(blender.num_layers)]
        for pool in pools:
            pool.load(slot, layers)
    return pools


@torch.inference_mode()
def test_the_kernel_step_computes_what_the_models_layers_compute(tiny_blender):
    """Logits and pool writes as the model's layers give them, step after step, for Llama, Mistral and Qwen2
    (q/k/v biases), up to the float16 pool: over one step, logits and the K/V written within float16's rounding
    of the layers'; over four, the same top tokens. (The probe holds the step to float32's rounding.)"""
    decoder = runtime(tiny_blender)
    assert isinstance(decoder.form, KernelStep), decoder.kernel_step_refusal  # the runtime's decode steps run it
    assert decoder.pool.keys.dtype == KernelStep.pool_dtype == torch.float16
    layer_pool, kernel_pool = filled_pools(tiny_blender, [torch.float32, KernelStep.pool_dtype])
    layers, kernel = LayerStep(tiny_blender.model), KernelStep(tiny_blender.model)
    tokens, positions = torch.tensor([5, 9, 3, 0]), torch.tensor(LENGTHS + [layer_pool.scratch])
    for step in range(4):
        columns = decoder.backend.key_columns(int(positions[:-1].max()) + 1, layer_pool.columns)
        want = layers.logits(layer_pool, tokens, positions, columns)
        got = kernel.logits(kernel_pool, tokens, positions, columns)
        assert torch.equal(got[:3].argmax(-1), want[:3].argmax(-1))
        if step == 0:  # the same K/V read but the new token's own, rounded in the kernel's pool
            assert torch.allclose(got[:3], want[:3], atol=1e-3, rtol=1e-3)
            for written, reference in ((kernel_pool.keys, layer_pool.keys), (kernel_pool.values, layer_pool.values)):
                assert torch.allclose(written[:, :3].float(), reference[:, :3], atol=1e-3, rtol=1e-3)
        tokens = want.argmax(-1)
        positions = torch.where(positions == layer_pool.scratch, positions, positions + 1)


def test_the_probe_refuses_a_step_off_by_more_than_the_models_rounding(monkeypatch):
    """The probe's verdict is the gate's: the real step passes; logits off by 1e-4 (a few ulps of float32 would
    pass) do not, and the reason says by how much."""
    step = KernelStep(Blender(tiny_model("llama"), None, "tiny").model)
    assert step.probe() is None
    logits = KernelStep.logits
    monkeypatch.setattr(KernelStep, "logits", lambda self, *args: logits(self, *args) + 1e-4)
    reason = step.probe()
    assert reason is not None and "does not reproduce the model's own forward" in reason and "0.0001" in reason


def test_a_layers_weights_reach_the_kernel_where_the_model_holds_them():
    """Qwen2's q/k/v: their weights (float32, or int4's codes, scales and mins) are the modules' own tensors, not
    copies, and their biases one vector in their order."""
    for weights in ("float32", "int4"):
        model = tiny_model("qwen2")
        quantize_linears(model, weights)
        attention = model.model.layers[0].self_attn
        linears = (attention.q_proj, attention.k_proj, attention.v_proj)
        tensors, bias = projection_weights(*linears)
        own = ([linear.weight for linear in linears] if weights == "float32" else
               [t for linear in linears for t in (linear.codes, linear.scales, linear.mins)])
        assert [t.data_ptr() for t in tensors] == [t.data_ptr() for t in own]
        assert torch.equal(bias, torch.cat([linear.bias for linear in linears]))


def scaled_attention(model, factor: float):
    """The attention modules' output times `factor`: math the kernel step, which runs its own attention, skips."""
    for layer in model.model.layers:
        forward = layer.self_attn.forward
        layer.self_attn.forward = lambda *args, _forward=forward, **kwargs: (
            lambda out: (out[0] * factor, out[1]))(_forward(*args, **kwargs))
    return model


def qwen3():
    torch.manual_seed(0)
    config = Qwen3Config(**TINY, head_dim=16)
    config._attn_implementation = BLEND_ATTENTION
    return Qwen3ForCausalLM(config).eval()


@pytest.mark.parametrize("case, reason", [
    ("qwen3 q/k norms", "not a Llama-shaped layer"),
    ("attention the step would not reproduce", "does not reproduce the model's own forward"),
    ("no CPU kernels", "the CPU kernels are off"),
    ("a sliding window", "sliding window"),
    ("a GELU MLP", "not SiLU"),
])
def test_what_the_kernel_step_would_not_reproduce_decodes_through_the_models_layers(case, reason):
    model = {"qwen3 q/k norms": qwen3, "no CPU kernels": lambda: tiny_model("llama"),
             "attention the step would not reproduce": lambda: scaled_attention(tiny_model("llama"), 1.5),
             "a sliding window": lambda: tiny_model("mistral", sliding_window=8),
             "a GELU MLP": lambda: tiny_model("llama", hidden_act="gelu")}[case]()
    kernels = "off" if case == "no CPU kernels" else "auto"
    blender = Blender(model, tokenizer=None, fingerprint="tiny", cpu_kernel=kernels)
    decoder = DecodeRuntime(blender, slots=2, max_len=64)
    assert isinstance(decoder.form, LayerStep) and reason in decoder.kernel_step_refusal
    ids = random_ids(11, 50)  # past the window, where there is one
    want, _ = hf_greedy(blender, ids, 8)
    assert list(decoder.generate(blender.full_prefill(ids), SamplingParams(8))) == want
