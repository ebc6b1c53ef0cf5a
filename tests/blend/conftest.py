"""Tiny randomly initialised Llama / Mistral / Qwen2 models (no weights) for fast blend tests."""
from __future__ import annotations

import os
import weakref

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from blend import BLEND_ATTENTION, Blender, DecodeRuntime, SamplingParams

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024)
# bench/device_check.sh runs some blend tests with RAGBLEND_TEST_DEVICE=cuda; CPU is the tested default.
TEST_DEVICE = torch.device(os.environ.get("RAGBLEND_TEST_DEVICE", "cpu"))
ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
}


def tiny_model(arch: str, **overrides):
    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(0)
    config = config_cls(**{**TINY, **extra, **overrides})
    config._attn_implementation = BLEND_ATTENTION
    model = model_cls(config).to(TEST_DEVICE).eval()
    # Random init gives near-uniform logits; widen the weights so attention patterns matter.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return model


@pytest.fixture(params=sorted(ARCHS))
def tiny_blender(request) -> Blender:
    return Blender(tiny_model(request.param), tokenizer=None, fingerprint=f"tiny-{request.param}")


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, TINY["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


_runtimes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def runtime(blender: Blender) -> DecodeRuntime:
    """The blender's decode runtime for tests that just decode (4 slots of 512 positions), built once."""
    if blender not in _runtimes:
        _runtimes[blender] = DecodeRuntime(blender, slots=4, max_len=512)
    return _runtimes[blender]


def generate(blender: Blender, prefill, sampling: SamplingParams = SamplingParams()) -> list[int]:
    """An answer's tokens (an ending eos included), decoded alone through the blender's runtime."""
    return list(runtime(blender).generate(prefill, sampling))
