"""The blender on the real embedded SmolLM2 and real MuSiQue passages."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from blend import Blender, DecodeRuntime, PromptFormat, SamplingParams, TextStream
from blend.batch import LayerStep
from blend.kernel_step import KernelStep
from blend.pool import KVPool

pytestmark = pytest.mark.slow
DEFAULTS = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"
SYSTEM = yaml.safe_load(DEFAULTS.read_text())["model"]["system_prompt"]  # (blend tests import nothing from app)


@pytest.fixture(scope="module")
def blender(smollm) -> Blender:
    return Blender(smollm.model, smollm.tokenizer, smollm.fingerprint)


@pytest.fixture(scope="module")
def decoder(blender) -> DecodeRuntime:
    return DecodeRuntime(blender, slots=2, max_len=4096)


@pytest.fixture(scope="module")
def prompt(smollm) -> PromptFormat:
    return PromptFormat(smollm.tokenizer, SYSTEM)


def build(blender: Blender, prompt: PromptFormat, item: dict, passages: int):
    head = blender.precompute(prompt.head_ids)
    chunks = [blender.precompute(prompt.text_passage_ids(c["text"], c["title"]), prompt.head_ids, context=head)
              for c in item["ctxs"][:passages]]
    suffix = prompt.suffix_ids(item["question"])
    ids = prompt.head_ids + [i for c in chunks for i in c.token_ids.tolist()] + suffix
    return [head, *chunks], suffix, ids


def answer(decoder: DecodeRuntime, prefill, n: int = 12) -> list[int]:
    return list(decoder.generate(prefill, SamplingParams(max_new_tokens=n)))


def test_loader_answers_a_simple_chat_prompt(smollm, blender, decoder):
    ids = smollm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False)
    text = smollm.tokenizer.decode(answer(decoder, blender.full_prefill(ids), 12), skip_special_tokens=True)
    assert "Paris" in text


def test_ratio_one_matches_full_prefill_on_real_passages(blender, decoder, prompt, musique):
    segments, suffix, ids = build(blender, prompt, musique[0], passages=2)
    full, blended = blender.full_prefill(ids), blender.prefill(segments, suffix, ratio=1.0)
    assert (blended.logits - full.logits).abs().max() < 1e-3
    assert answer(decoder, blended) == answer(decoder, blender.full_prefill(ids))


def kl_over_answer(blender: Blender, full_logits: torch.Tensor, prefill, target: list[int]) -> float:
    """Mean KL(full ‖ mode) over the full-prefill answer, teacher-forced."""
    p = torch.log_softmax(full_logits, -1)
    q = torch.log_softmax(blender.teacher_force(prefill, target), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def test_hkvd_selection_beats_random_selection(blender, decoder, prompt, musique):
    hkvd, rand = [], []
    for item in musique[:3]:
        segments, suffix, ids = build(blender, prompt, item, passages=3)
        target = answer(decoder, blender.full_prefill(ids), 8)
        full_logits = blender.teacher_force(blender.full_prefill(ids), target)
        hkvd.append(kl_over_answer(blender, full_logits, blender.prefill(segments, suffix, 0.15), target))
        rand.append(kl_over_answer(blender, full_logits,
                                   blender.prefill(segments, suffix, 0.15, selection="random", seed=0), target))
    print(f"mean KL at 15%: hkvd {sum(hkvd) / 3:.4f}, random {sum(rand) / 3:.4f}")
    assert sum(hkvd) < sum(rand)


def test_stream_stops_at_stop_string_and_eos(smollm, blender, decoder):
    ids = smollm.tokenizer.apply_chat_template([{"role": "user", "content": "Count from 1 to 20, comma-separated."}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False)
    stream = TextStream(smollm.tokenizer, stop=("5",), eos_ids=decoder.eos_ids)
    text = "".join(decoder.generate(blender.full_prefill(ids), SamplingParams(max_new_tokens=60), stream))
    assert stream.finish_reason == "stop" and "5" not in text and "4" in text and text == stream.text
    assert decoder.pool.free == decoder.pool.slots  # the slot is back once the answer stopped

    stream = TextStream(smollm.tokenizer, eos_ids=decoder.eos_ids)
    "".join(decoder.generate(blender.full_prefill(ids), SamplingParams(max_new_tokens=3), stream))
    assert stream.finish_reason == "length" and len(stream.tokens) == 3


def test_sampling_is_seeded_and_varies(smollm, blender, decoder):
    ids = smollm.tokenizer.apply_chat_template([{"role": "user", "content": "Write a word."}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False)

    def sample(seed: int) -> list[int]:
        return list(decoder.generate(blender.full_prefill(ids), SamplingParams(6, temperature=1.5, top_p=0.95,
                                                                               seed=seed)))

    assert sample(1) == sample(1)
    assert len({tuple(sample(s)) for s in range(4)}) > 1


def test_the_real_model_answers_over_its_float16_pool_as_over_a_float32_one(blender, decoder, prompt, musique):
    """The kernel step keeps the pool's K/V in float16 (half the bytes a step reads): a blended MuSiQue prompt's
    24-token greedy answer is the one the same step gives over a float32 pool."""
    assert decoder.pool.keys.dtype == torch.float16
    segments, suffix, _ = build(blender, prompt, musique[2], 3)
    prefill = blender.prefill(segments, suffix, 0.15)
    over_float16, pool = answer(decoder, prefill, 24), decoder.pool
    decoder.pool = KVPool(blender.num_layers, blender.kv_heads, blender.head_dim, slots=1, max_len=pool.max_len,
                          dtype=torch.float32, device="cpu")
    try:
        over_float32 = answer(decoder, prefill, 24)
    finally:
        decoder.pool = pool
    assert over_float16 == over_float32


def test_planned_attention_changes_nothing_at_15_percent(blender, prompt, musique, monkeypatch):
    """The whole blend at 15% with the planned attention equals it with sdpa over an explicit mask."""
    import blend.attention

    segments, suffix, _ = build(blender, prompt, musique[1], passages=3)
    planned = blender.prefill(segments, suffix, ratio=0.15)
    monkeypatch.setattr(blend.attention, "planned_attention", lambda q, k, v, plan, scale=None:
                        blend.attention.dense_attention(q, k, v, plan.positions, scale))
    dense = blender.prefill(segments, suffix, ratio=0.15)
    assert torch.equal(planned.selected, dense.selected)
    assert (planned.logits - dense.logits).abs().max() < 1e-3


def test_the_real_model_decodes_through_the_kernel_step_as_through_its_layers(blender, decoder, prompt, musique):
    """SmolLM2 passes the kernel step's probe, and answers a blended MuSiQue prompt with the same tokens through
    the kernel step as through its layers (blend.batch.LayerStep), both over the pool's float16 K/V."""
    assert isinstance(decoder.form, KernelStep), decoder.kernel_step_refusal
    segments, suffix, _ = build(blender, prompt, musique[0], 3)
    prefill = blender.prefill(segments, suffix, 0.15)
    through_kernels = answer(decoder, prefill, 24)
    decoder.form = LayerStep(blender.model)
    try:
        through_layers = answer(decoder, prefill, 24)
    finally:
        decoder.form = KernelStep(blender.model)
    assert through_kernels == through_layers

