"""The kernel step (blend.kernel_step): Llama-shaped layers decode on the CPU kernels with the same bits as through
the HF layers (logits and the K/V written into the pool, rows of different lengths, a padding row); a model
whose layers are not Llama's shape, or whose math the step would not reproduce, decodes through the HF layers,
with the reason, and still gives the model's own tokens."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from blend import BLEND_ATTENTION, Blender, SamplingParams
from blend.batch import DecodeStepper
from blend.kernel_step import KernelStep, Projections
from blend.pool import KVPool
from tests.blend.conftest import TEST_DEVICE, TINY, random_ids, tiny_model
from tests.blend.test_batch_decode import hf_greedy

pytestmark = [pytest.mark.skipif(TEST_DEVICE.type != "cpu", reason="the CPU kernels"),
              pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")]

LENGTHS = [17, 40, 5]  # rows' cached tokens; a fourth row pads


def filled_pools(blender: Blender, count: int) -> list[KVPool]:
    """`count` pools holding the same random K/V for LENGTHS in slots 0..2."""
    pools = [KVPool(blender.num_layers, blender.kv_heads, blender.head_dim, slots=4, max_len=200,
                    dtype=torch.float32, device="cpu") for _ in range(count)]
    generator = torch.Generator().manual_seed(0)
    for pool in pools:
        pool.readable(4, pool.columns)
    for slot, length in enumerate(LENGTHS):
        shape = (1, blender.kv_heads, length, blender.head_dim)
        layers = [(torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
                  for _ in range(blender.num_layers)]
        for pool in pools:
            pool.load(slot, layers)
    return pools


@torch.inference_mode()
def test_the_kernel_step_gives_the_hf_layers_bits(tiny_blender):
    """Logits and pool writes equal bit for bit, step after step, for Llama, Mistral and Qwen2 (q/k/v biases)."""
    stepper = tiny_blender.stepper  # the Blender's own decode steps run it
    assert stepper.kernel_step is not None, stepper.kernel_step_refusal
    hf_pool, kernel_pool = filled_pools(tiny_blender, 2)
    hf = DecodeStepper(tiny_blender.model, hf_pool, tiny_blender.num_layers, attention_kernel=True,
                       use_kernel_step=False)
    kernel = KernelStep(tiny_blender.model, tiny_blender.num_layers)
    tokens, positions = torch.tensor([5, 9, 3, 0]), torch.tensor(LENGTHS + [hf_pool.scratch])
    for _ in range(4):
        columns = hf.key_columns(positions.tolist())
        want = hf.logits(tokens, positions, columns)
        assert torch.equal(kernel.logits(kernel_pool, tokens, positions, columns), want)
        assert torch.equal(kernel_pool.keys, hf_pool.keys) and torch.equal(kernel_pool.values, hf_pool.values)
        tokens = want.argmax(-1)
        positions = torch.where(positions == hf_pool.scratch, positions, positions + 1)


@torch.inference_mode()
def test_projections_give_each_linears_output_and_leave_the_weights_where_they_are():
    """Qwen2's q/k/v, with their biases, as one call: each module's own output, the modules' weights untouched."""
    blender = Blender(tiny_model("qwen2"), tokenizer=None, fingerprint="tiny-qwen2")
    attention = blender.model.model.layers[0].self_attn
    linears = (attention.q_proj, attention.k_proj, attention.v_proj)
    pointers = [linear.weight.data_ptr() for linear in linears]
    x = torch.randn(3, attention.q_proj.in_features, generator=torch.Generator().manual_seed(6))
    outputs = Projections(*linears)(x)
    assert all(torch.equal(got, linear(x)) for got, linear in zip(outputs, linears))
    assert [linear.weight.data_ptr() for linear in linears] == pointers


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
    ("attention the step would not reproduce", "must be the same bits"),
    ("no CPU kernels", "not the CPU kernel"),
])
def test_what_the_kernel_step_would_not_reproduce_decodes_through_the_hf_layers(case, reason):
    model = {"qwen3 q/k norms": qwen3, "no CPU kernels": lambda: tiny_model("llama"),
             "attention the step would not reproduce": lambda: scaled_attention(tiny_model("llama"), 1.5)}[case]()
    kernels = "off" if case == "no CPU kernels" else "auto"
    blender = Blender(model, tokenizer=None, fingerprint="tiny", cpu_kernel=kernels)
    blender.configure_decode(slots=2, max_len=64)
    assert blender.unsupported is None  # it blends, and decodes in the pool
    assert blender.stepper.kernel_step is None
    assert reason in blender.stepper.kernel_step_refusal
    ids = random_ids(11, 50)
    want, _ = hf_greedy(blender, ids, 8)
    assert list(blender.decode(blender.full_prefill(ids), SamplingParams(8))) == want
