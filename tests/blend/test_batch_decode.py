"""Decoding in the KV pool on tiny Llama / Mistral / Qwen2: each row gets exactly what it gets alone, rows join
and leave at any step (their slots reused), sampling on the device gives torch.multinomial's tokens for a
seed, the graph wrapper's static-buffer logic replays the eager step exactly, and the step through the model's
layers (blend.batch.LayerStep, the pooled attention) is the model's own forward: its sliding window and its
logit softcapping included, for a model the blend gate refused too."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from blend import Blender, DecodeRuntime, SamplingParams
from blend.batch import LayerStep, bucket, buckets
from blend.decode import draw_noise, sample_next, sample_rows, sampling_rows
from blend.graphs import StepGraphs
from blend.pool import KVPool, PoolFull, PoolTooShort
from tests.blend.conftest import TEST_DEVICE, generate, random_ids, runtime, tiny_model

PROMPTS = [random_ids(11, 21), random_ids(37, 22), random_ids(5, 23), random_ids(64, 24), random_ids(20, 25)]
STEPS = 12


def hf_greedy(blender: Blender, ids: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Reference: HF's own forward with a plain DynamicCache, greedy, one request."""
    cache, tokens, logits_seen = DynamicCache(), [], []
    with torch.no_grad():
        out = blender.model(input_ids=torch.tensor([ids], device=TEST_DEVICE), cache=cache, use_cache=True)
        for step in range(n):
            logits = out.logits[0, -1].float().cpu()
            logits_seen.append(logits)
            tokens.append(int(logits.argmax()))
            position = len(ids) + step
            out = blender.model(input_ids=torch.tensor([[tokens[-1]]], device=TEST_DEVICE),
                                position_ids=torch.tensor([[position]], device=TEST_DEVICE), cache=cache,
                                use_cache=True)
    return tokens, logits_seen


def reference_sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """sample_next as it was before sampling moved to the device (torch.multinomial on the host)."""
    if params.temperature < 1e-4:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > params.top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def test_alone_matches_hf_forward(tiny_blender):
    decoder = runtime(tiny_blender)
    for ids in PROMPTS[:2]:
        want, want_logits = hf_greedy(tiny_blender, ids, STEPS)
        prefill = tiny_blender.full_prefill(ids)
        assert generate(tiny_blender, prefill, SamplingParams(STEPS)) == want
        # the step through the model's layers, its logits themselves, over a pool's masked keys (of the model's
        # dtype, as the runtime's pool is where the layers are its step)
        pool = KVPool(tiny_blender.num_layers, tiny_blender.kv_heads, tiny_blender.head_dim, slots=1, max_len=64,
                      dtype=tiny_blender.dtype, device=TEST_DEVICE)
        pool.load(pool.acquire(), [(layer.keys, layer.values) for layer in prefill.cache.layers])
        step_form, token = LayerStep(tiny_blender.model), want[0]
        for step in range(1, 4):
            position = len(ids) + step - 1
            rows = torch.tensor([token], device=TEST_DEVICE)
            positions = torch.full((1,), position, device=TEST_DEVICE)
            columns = decoder.backend.key_columns(position + 1, pool.columns)
            pool.readable(1, columns)  # as DecodeRuntime.step does before each step
            with torch.inference_mode():
                logits = step_form.logits(pool, rows, positions, columns)[0].float().cpu()
            assert (logits - want_logits[step]).abs().max() < 1e-4
            token = want[step]


def test_batched_rows_equal_each_request_alone_joining_and_leaving(tiny_blender):
    """Five requests of different lengths in a 4-slot pool; they start at steps 0, 0, 3, 7 and 9 (request 3
    in the slot request 1 left) and stop after different counts. Every row must produce exactly its greedy
    tokens alone, at every batch composition and slot."""
    decoder = DecodeRuntime(tiny_blender, slots=4, max_len=128)
    alone = [hf_greedy(tiny_blender, ids, STEPS)[0] for ids in PROMPTS]
    starts, lengths = [0, 0, 3, 7, 9], [STEPS, 5, STEPS, 4, STEPS]
    active, done, slots_seen = [], {}, {}
    for step in range(STEPS + 12):
        for i, s in enumerate(starts):
            if s == step:
                seq = decoder.start(tiny_blender.full_prefill(PROMPTS[i]), SamplingParams(lengths[i]),
                                    eos_ids=frozenset())
                active.append((i, seq))
                slots_seen[i] = seq.slot
        for row in [r for r in active if r[1].finish_reason is not None]:
            done[row[0]] = row[1].tokens
            row[1].release()
            active.remove(row)
        if active:
            decoder.advance([seq for _, seq in active])  # one batched step; each row accepts its token
    assert sorted(done) == [0, 1, 2, 3, 4]
    for i, tokens in done.items():
        assert tokens == alone[i][: lengths[i]], f"request {i}"
    assert slots_seen[3] == slots_seen[1] == 1  # request 3 took the slot request 1 had left
    assert decoder.pool.free == 4


def decoded_together(decoder: DecodeRuntime, sequences, n: int) -> list[list[int]]:
    """`n` tokens of each sequence, every step one batched DecodeRuntime.advance over all of them."""
    for _ in range(n - 1):
        decoder.advance(sequences)
    return [s.tokens[:n] for s in sequences]


def test_sampled_rows_in_a_batch_equal_each_alone_and_torch_multinomial(tiny_blender):
    """Seeded temperature / top-p requests give the same tokens alone, batched with a greedy row, and as the
    host-side torch.multinomial sampler gave them before (replayed over the same logits)."""
    params = [SamplingParams(8, temperature=1.3, seed=5), SamplingParams(8, temperature=0.9, top_p=0.8, seed=6),
              SamplingParams(8)]
    alone = [generate(tiny_blender, tiny_blender.full_prefill(ids), p) for ids, p in zip(PROMPTS, params)]
    assert alone[0] != alone[1]
    decoder = runtime(tiny_blender)
    seqs = [decoder.start(tiny_blender.full_prefill(ids), p) for ids, p in zip(PROMPTS, params)]
    assert decoded_together(decoder, seqs, 8) == alone
    for s in seqs:
        s.release()
    # the old sampler over the same logits (the HF forward's, teacher-forced on these tokens)
    for ids, p, want in zip(PROMPTS, params, alone):
        prefill = tiny_blender.full_prefill(ids)
        logits = tiny_blender.teacher_force(prefill, want)
        generator = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
        assert [reference_sample(row, p, generator) for row in logits] == want


def test_sample_rows_equals_the_multinomial_sampler_for_a_seed():
    logits = torch.randn(6, 500) * 4
    params = [SamplingParams(temperature=t, top_p=q) for t, q in
              [(0.0, 1.0), (0.7, 1.0), (1.5, 0.9), (1.0, 0.5), (0.0, 0.3), (2.0, 1.0)]]
    for seed in range(20):
        generators = [torch.Generator().manual_seed(seed + b) for b in range(6)]
        temperature, top_p = sampling_rows(params)
        got = sample_rows(logits, temperature, top_p, draw_noise(params, generators, 500)).tolist()
        want = [reference_sample(row, p, torch.Generator().manual_seed(seed + b))
                for b, (row, p) in enumerate(zip(logits, params))]
        assert got == want
        alone = [sample_next(row, p, torch.Generator().manual_seed(seed + b))
                 for b, (row, p) in enumerate(zip(logits, params))]
        assert alone == want


def test_pool_slots_are_reused_lowest_first_and_released_once():
    pool = KVPool(2, 3, 4, slots=3, max_len=10, dtype=torch.float32, device="cpu")
    assert pool.columns == 64 and pool.scratch == 63
    a, b, c = pool.acquire(), pool.acquire(), pool.acquire()
    assert (a, b, c) == (0, 1, 2) and pool.free == 0
    with pytest.raises(PoolFull):
        pool.acquire()
    pool.release(b)
    with pytest.raises(ValueError):
        pool.release(b)
    assert pool.acquire() == 1
    with pytest.raises(PoolTooShort):
        pool.load(0, [(torch.zeros(1, 3, 11, 4), torch.zeros(1, 3, 11, 4))] * 2)


def test_a_step_reads_finite_keys_and_the_pool_is_touched_only_as_far_as_steps_read():
    pool = KVPool(2, 3, 4, slots=3, max_len=200, dtype=torch.float32, device="cpu")
    assert pool.columns == 256
    pool.keys.fill_(float("nan"))  # what untouched memory may hold
    pool.values.fill_(float("nan"))
    prompt = torch.full((1, 3, 10, 4), 2.0)
    pool.load(pool.acquire(), [(prompt, prompt)] * 2)
    pool.readable(2, 64)
    for kv in (pool.keys, pool.values):
        assert torch.isfinite(kv[:, :2, :, :64]).all()
        assert kv[:, 0, :, :10].eq(2).all() and kv[:, :2, :, 10:64].eq(0).all()  # the prompt kept, the rest zeros
        assert kv[:, :, :, 64:].isnan().all() and kv[:, 2].isnan().all()  # nothing past what a step reads
    pool.keys[:, 1, :, 20] = 5.0  # a token decoded into slot 1: a later, wider read keeps it
    pool.readable(2, 128)
    assert pool.keys[:, 1, :, 20].eq(5).all() and torch.isfinite(pool.keys[:, :2, :, :128]).all()
    assert pool.keys[:, :2, :, 128:].isnan().all()


@pytest.mark.parametrize("cpu_kernel", ["auto", "off"])
def test_decoding_over_a_pool_of_garbage_gives_the_tokens_alone(tiny_blender, cpu_kernel):
    """Whatever the pool's untouched memory holds (NaN here): sdpa's masked keys are made finite first, the
    CPU kernel reads no key past a row's length."""
    blender = Blender(tiny_blender.model, tokenizer=None, fingerprint=tiny_blender.fingerprint, cpu_kernel=cpu_kernel)
    decoder = DecodeRuntime(blender, slots=2, max_len=300)
    decoder.pool.keys.fill_(float("nan"))
    decoder.pool.values.fill_(float("nan"))
    want = hf_greedy(blender, PROMPTS[3], STEPS)[0]
    assert list(decoder.generate(blender.full_prefill(PROMPTS[3]), SamplingParams(STEPS))) == want


def test_a_cancelled_decode_frees_its_slot_and_the_prefill_cache_is_untouched(tiny_blender):
    decoder = DecodeRuntime(tiny_blender, slots=2, max_len=96)
    prefill = tiny_blender.full_prefill(PROMPTS[1])
    before = prefill.cache.layers[0].keys.clone()
    stream = decoder.generate(prefill, SamplingParams(10))
    pointer = decoder.pool.keys.data_ptr()
    assert [next(stream) for _ in range(4)] and decoder.pool.free == 1
    stream.close()  # the consumer stopped (a stop string, a cancelled request)
    assert decoder.pool.free == 2
    assert torch.equal(prefill.cache.layers[0].keys, before)
    assert decoder.pool.keys.data_ptr() == pointer  # nothing reallocated: decoding wrote in place
    with pytest.raises(PoolTooShort, match="96-token decode pool"):
        decoder.start(prefill, SamplingParams(96 - len(PROMPTS[1]) + 2))


def test_buckets_cover_every_batch_size():
    assert buckets(8) == [1, 2, 4, 8] and buckets(6) == [1, 2, 4, 6] and buckets(1) == [1]
    assert [bucket(n, 6) for n in range(1, 7)] == [1, 2, 4, 4, 6, 6]


class FakeCapture:
    """Stands in for CUDA graph capture on the CPU: the 'graph' reruns the captured closure, which may read
    only the static buffers it was captured over (as a real graph would)."""

    def __init__(self, fail: bool = False):
        self.fail, self.captures = fail, 0

    def __call__(self, fn):
        self.captures += 1
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        out = fn()  # the step's static outputs (a tuple of tensors), refilled by each replay
        return out, lambda: [static.copy_(fresh) for static, fresh in zip(out, fn())]


def test_graphed_step_replays_the_eager_tokens_with_one_capture_per_shape():
    blender = Blender(tiny_model("llama"), tokenizer=None, fingerprint="tiny")
    eager, graphed = (DecodeRuntime(blender, slots=4, max_len=200) for _ in range(2))
    capture = FakeCapture()
    graphed.graphs = StepGraphs(enabled=True, capture=capture)  # the CPU stand-in for CUDA's capture
    params = [SamplingParams(10), SamplingParams(10, temperature=1.1, seed=3), SamplingParams(10)]
    want = [list(eager.generate(blender.full_prefill(ids), p)) for ids, p in zip(PROMPTS, params)]
    got = [list(graphed.generate(blender.full_prefill(ids), p)) for ids, p in zip(PROMPTS, params)]
    assert got == want
    # one request at a time, all in slot 0, under 256 keys: one graph for greedy rows, one for sampled rows
    assert sorted(graphed.graphs.captured) == [(1, 256, False, False, False), (1, 256, True, False, False)]
    assert capture.captures == 2
    with_logprobs = SamplingParams(10, top_logprobs=2)  # a graph of its own, its logprobs those of the eager step
    assert answer_with_logprobs(graphed, blender, PROMPTS[0], with_logprobs) == \
        answer_with_logprobs(eager, blender, PROMPTS[0], with_logprobs)
    assert (1, 256, False, False, True) in graphed.graphs.captured


def answer_with_logprobs(decoder: DecodeRuntime, blender: Blender, ids: list[int], params: SamplingParams,
                         beside: list[int] | None = None) -> tuple[list[int], list]:
    """One answer step by step (with a row `beside` it in every step, whose tokens are checked against its tokens
    alone): its tokens and its sequence's logprobs."""
    sequence = decoder.start(blender.full_prefill(ids), params)
    other = decoder.start(blender.full_prefill(beside), SamplingParams(params.max_new_tokens)) if beside else None
    tokens, others = [sequence.first_token], [other.first_token] if other else []
    for _ in range(params.max_new_tokens - 1):
        rows = [sequence, other] if other else [sequence]
        following = decoder.step(rows, [tokens[-1], *others[-1:]], [r.length for r in rows])
        tokens.append(following[0])
        others += following[1:]
    for row in (sequence, other):
        if row is not None:
            row.release()
    if beside:
        assert others == generate(blender, blender.full_prefill(beside), SamplingParams(params.max_new_tokens))
    return tokens, sequence.logprobs


def test_logprobs_are_the_models_own_and_change_no_token(tiny_blender):
    decoder, ids = runtime(tiny_blender), PROMPTS[1]
    want, logits = hf_greedy(tiny_blender, ids, STEPS)
    tokens, logprobs = answer_with_logprobs(decoder, tiny_blender, ids, SamplingParams(STEPS, top_logprobs=3),
                                            beside=PROMPTS[2])  # a row without logprobs beside it
    assert tokens == want and [lp.token for lp in logprobs] == tokens
    for lp, row in zip(logprobs, logits):
        reference = torch.log_softmax(row, dim=-1)                                            # [V]
        # within the decode pool's float16 rounding of K/V (blend.kernel_step)
        assert lp.logprob == pytest.approx(float(reference[lp.token]), abs=1e-3)
        assert [t for t, _ in lp.top] == reference.topk(3).indices.tolist() and lp.top[0][0] == lp.token  # greedy
        assert [v for _, v in lp.top] == pytest.approx(reference.topk(3).values.tolist(), abs=1e-3)
    sampled = SamplingParams(STEPS, temperature=1.3, seed=7)
    alone, _ = answer_with_logprobs(decoder, tiny_blender, ids, sampled)
    drawn, kept = answer_with_logprobs(decoder, tiny_blender, ids, SamplingParams(STEPS, 1.3, seed=7, top_logprobs=0))
    assert drawn == alone and all(lp.top == () for lp in kept)  # the same draws; no alternatives asked


def test_a_failed_capture_falls_back_to_eager_with_the_reason():
    blender = Blender(tiny_model("llama"), tokenizer=None, fingerprint="tiny")
    decoder = DecodeRuntime(blender, slots=2, max_len=64)
    want = list(decoder.generate(blender.full_prefill(PROMPTS[0]), SamplingParams(6)))
    decoder.graphs = StepGraphs(enabled=True, capture=FakeCapture(fail=True))
    assert list(decoder.generate(blender.full_prefill(PROMPTS[0]), SamplingParams(6))) == want
    assert "capture failed" in decoder.cuda_graphs and "stream is capturing" in decoder.cuda_graphs
    assert not decoder.graphs.enabled


def own_model(arch: str):
    """A Mistral with an 8-token sliding window, and a Gemma2 (sliding layers, logit softcapping, scaled
    embeddings: the blend gate refuses it, and it keeps its own eager attention for prefills)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from tests.blend.conftest import TINY
    if arch == "mistral, window 8":
        return tiny_model("mistral", sliding_window=8)
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(**TINY, head_dim=16, sliding_window=8)).to(TEST_DEVICE).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return model


@pytest.mark.parametrize("arch", ["mistral, window 8", "gemma2, refused"])
def test_rows_decode_through_the_pool_as_the_models_own_forward(arch):
    """Rows of different lengths, past the window, in one batched step: each gets the greedy tokens of the model's
    own forward over its own cache (its window, its softcap, its embedding scale), through the pooled attention."""
    blender = Blender(own_model(arch), tokenizer=None, fingerprint="tiny")
    assert (blender.unsupported is not None) == (arch == "gemma2, refused")
    decoder = DecodeRuntime(blender, slots=4, max_len=128)
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[3]]  # 11, 5 and 64 tokens
    alone = [hf_greedy(blender, ids, 8)[0] for ids in prompts]
    seqs = [decoder.start(blender.full_prefill(ids), SamplingParams(8)) for ids in prompts]
    assert decoded_together(decoder, seqs, 8) == alone
    if blender.unsupported:  # the step's dispatch to the pooled attention was given back
        assert blender.model.config._attn_implementation == "eager"
