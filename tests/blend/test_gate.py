"""The model gate: models or prompts the blend loop cannot run exactly get the model's own full prefill."""
from __future__ import annotations

import pytest
import torch
from transformers import (
    DynamicCache,
    Gemma2Config,
    Gemma2ForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from blend import BLEND_ATTENTION, Blender, SamplingParams
from blend.gate import static_refusal
from tests.blend.conftest import TINY, generate, runtime, tiny_model
from tests.blend.test_prefill import CHUNKS, SUFFIX, prompt_ids, segments


def build(config_cls, model_cls, **overrides):
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**TINY, **overrides})).eval()  # the model's own attention; the Blender decides
    with torch.no_grad():  # as in conftest: wider weights, so attention patterns (and windows) matter
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return model


def own_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1].float()


def own_greedy(model, ids: list[int], eos: frozenset[int], n: int = 8) -> list[int]:
    """Greedy tokens from the model's own forward and its own cache (sliding layers included)."""
    cache, tokens = DynamicCache(config=model.config), []
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), cache=cache).logits[0, -1]
        for _ in range(n):
            tokens.append(int(logits.argmax()))
            if tokens[-1] in eos:
                break
            logits = model(input_ids=torch.tensor([[tokens[-1]]]), cache=cache).logits[0, -1]
    return tokens


def assert_runs_like_the_model(blender: Blender, result) -> None:
    ids = prompt_ids()
    assert (result.logits - own_logits(blender.model, ids)).abs().max() < 1e-4
    blended = generate(blender, result, SamplingParams(max_new_tokens=8))
    assert blended == own_greedy(blender.model, ids, runtime(blender).eos_ids)


WINDOWED = {
    "mistral": lambda window: build(MistralConfig, MistralForCausalLM, sliding_window=window),
    "qwen2": lambda window: build(Qwen2Config, Qwen2ForCausalLM, use_sliding_window=True, max_window_layers=1,
                                  sliding_window=window),
}


@pytest.mark.parametrize("arch", sorted(WINDOWED))
def test_prompt_longer_than_the_sliding_window_falls_back_exactly(arch):
    model = WINDOWED[arch](24)
    blender = Blender(model, None, f"tiny-{arch}")
    assert blender.unsupported is None and blender.sliding_window == 24
    result = blender.prefill(segments(blender), SUFFIX, ratio=0.15)
    assert len(prompt_ids()) > 24
    assert "sliding window" in result.stats.fallback and result.stats.recomputed_tokens == 0
    assert_runs_like_the_model(blender, result)
    # The window matters here: the same weights without it give other logits.
    unwindowed = WINDOWED[arch](None) if arch == "mistral" else build(Qwen2Config, Qwen2ForCausalLM)
    assert (own_logits(unwindowed, prompt_ids()) - result.logits).abs().max() > 1e-3


@pytest.mark.parametrize("arch", sorted(WINDOWED))
def test_prompt_within_the_sliding_window_blends_exactly(arch):
    blender = Blender(WINDOWED[arch](len(prompt_ids())), None, f"tiny-{arch}")
    segs = segments(blender, conditioned=False)
    result = blender.prefill(segs, SUFFIX, ratio=1.0)
    assert result.stats.fallback is None and result.stats.recomputed_tokens > 0
    assert_runs_like_the_model(blender, result)
    assert blender.prefill(segs, SUFFIX, ratio=0.2).stats.fallback is None


def test_gemma2_softcapping_is_refused_and_runs_its_own_forward():
    model = build(Gemma2Config, Gemma2ForCausalLM, head_dim=16, sliding_window=16)
    blender = Blender(model, None, "tiny-gemma2")
    assert "softcapping" in blender.unsupported
    assert model.config._attn_implementation != BLEND_ATTENTION  # its own attention applies the softcap
    result = blender.prefill(segments(blender), SUFFIX, ratio=0.15)
    assert result.stats.fallback == blender.unsupported
    assert_runs_like_the_model(blender, result)
    assert (blender.full_prefill(prompt_ids()).logits - own_logits(model, prompt_ids())).abs().max() < 1e-4


def test_probe_refuses_a_forward_the_loop_does_not_reproduce():
    # Granite scales embeddings and logits outside its decoder layers, which the loop never calls.
    model = build(GraniteConfig, GraniteForCausalLM, embedding_multiplier=6.0, logits_scaling=4.0)
    assert static_refusal(model) is None
    blender = Blender(model, None, "tiny-granite")
    assert "does not reproduce GraniteForCausalLM" in blender.unsupported
    result = blender.prefill(segments(blender), SUFFIX, ratio=0.15)
    assert result.stats.fallback == blender.unsupported
    assert_runs_like_the_model(blender, result)


def test_probe_accepts_what_the_layers_apply():
    # Attention and residual multipliers live inside the layers the loop calls: blending stays exact.
    model = build(GraniteConfig, GraniteForCausalLM, attention_multiplier=0.05, residual_multiplier=0.5)
    blender = Blender(model, None, "tiny-granite")
    assert blender.unsupported is None
    result = blender.prefill(segments(blender, conditioned=False), SUFFIX, ratio=1.0)
    assert result.stats.fallback is None
    assert_runs_like_the_model(blender, result)


def test_layer_signature_the_loop_cannot_call_is_refused():
    class OddLayer(LlamaDecoderLayer):
        def forward(self, hidden_states, attention_mask=None):  # no cache / position_embeddings / **kwargs
            return hidden_states

    model = tiny_model("llama")
    for layer in model.model.layers:
        layer.__class__ = OddLayer
    assert "OddLayer.forward" in static_refusal(model)
    assert "OddLayer" in Blender(model, None, "odd").unsupported


def test_accepted_models_keep_the_blend_attention(tiny_blender):
    assert tiny_blender.unsupported is None and tiny_blender.shifter is not None
    assert tiny_blender.model.config._attn_implementation == BLEND_ATTENTION
    assert tiny_blender.prefill(segments(tiny_blender), SUFFIX, 0.3).stats.fallback is None
    assert len(CHUNKS) == 3  # the prompt these tests share: head + 3 chunks + suffix


def test_a_probe_that_raises_is_a_refusal_not_a_crash(monkeypatch):
    # On a GPU the blend loop's attention is compiled; a compiler failure must leave the model its own forward.
    def broken_plan(self, positions, num_keys=None):
        raise RuntimeError("no kernel for this shape")

    monkeypatch.setattr("blend.backend.Backend.plan", broken_plan)
    model = tiny_model("llama")
    blender = Blender(model, None, "tiny")
    assert blender.unsupported.startswith("the probe prompt failed in the blend loop: RuntimeError: no kernel")
    assert model.config._attn_implementation != BLEND_ATTENTION
    result = blender.prefill(segments(blender), SUFFIX, ratio=0.15)
    assert result.stats.fallback == blender.unsupported
    assert_runs_like_the_model(blender, result)
