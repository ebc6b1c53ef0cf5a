"""Batched decoding on tiny Llama / Mistral / Qwen2: each row gets exactly what it gets alone, rows join
and leave at any step, and a token is an O(1) write into its request's cache buffer."""
from __future__ import annotations

import torch
from transformers import DynamicCache

from blend import Blender
from blend.cache import BlendCache
from tests.blend.conftest import random_ids

PROMPTS = [random_ids(11, 21), random_ids(37, 22), random_ids(5, 23), random_ids(64, 24)]
STEPS = 12


def hf_greedy(blender: Blender, ids: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Reference: HF's own forward with a plain DynamicCache, greedy, one request."""
    cache, tokens, logits_seen = DynamicCache(), [], []
    with torch.no_grad():
        out = blender.model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
        for step in range(n):
            logits = out.logits[0, -1].float()
            logits_seen.append(logits)
            tokens.append(int(logits.argmax()))
            position = len(ids) + step
            out = blender.model(input_ids=torch.tensor([[tokens[-1]]]), position_ids=torch.tensor([[position]]),
                                cache=cache, use_cache=True)
    return tokens, logits_seen


def test_alone_matches_hf_forward(tiny_blender):
    for ids in PROMPTS[:2]:
        want, want_logits = hf_greedy(tiny_blender, ids, STEPS)
        prefill = tiny_blender.full_prefill(ids, reserve=STEPS)
        logits, tokens = prefill.logits, []
        for step in range(STEPS):
            assert (logits - want_logits[step]).abs().max() < 1e-4
            tokens.append(int(logits.argmax()))
            logits = tiny_blender.decode_step([prefill.cache], [tokens[-1]], [len(ids) + step])[0]
        assert tokens == want


def test_batched_rows_equal_each_request_alone_joining_and_leaving(tiny_blender):
    """Four requests of different lengths; they start at steps 0, 0, 3 and 7 and stop after different
    counts. Every row must produce exactly its greedy tokens alone, at every batch composition."""
    alone = [hf_greedy(tiny_blender, ids, STEPS)[0] for ids in PROMPTS]
    starts, lengths = [0, 0, 3, 7], [STEPS, 5, STEPS, 4]

    class Row:
        def __init__(self, i: int):
            self.i, self.ids = i, PROMPTS[i]
            self.prefill = tiny_blender.full_prefill(self.ids)  # no reserve: the cache grows as it goes
            self.tokens = [int(self.prefill.logits.argmax())]

    active: list[Row] = []
    done: dict[int, list[int]] = {}
    for step in range(STEPS + 8):
        active += [Row(i) for i, s in enumerate(starts) if s == step]
        for row in [r for r in active if len(r.tokens) == lengths[r.i]]:
            done[row.i] = row.tokens
            active.remove(row)
        if not active:
            continue
        logits = tiny_blender.decode_step([r.prefill.cache for r in active], [r.tokens[-1] for r in active],
                                          [len(r.ids) + len(r.tokens) - 1 for r in active])
        assert logits.shape == (len(active), tiny_blender.model.config.vocab_size)
        for row, row_logits in zip(active, logits):
            row.tokens.append(int(row_logits.argmax()))
    assert sorted(done) == [0, 1, 2, 3]
    for i, tokens in done.items():
        assert tokens == alone[i][: lengths[i]], f"request {i}"


def test_decode_writes_into_the_reserved_buffer_without_copying(tiny_blender):
    ids = PROMPTS[1]
    prefill = tiny_blender.full_prefill(ids, reserve=8)
    cache = prefill.cache
    assert cache.capacity == len(ids) + 8 and cache.get_seq_length() == len(ids)
    pointer = cache.layers[0].keys.data_ptr()
    token = int(prefill.logits.argmax())
    for step in range(8):
        token = int(tiny_blender.decode_step([cache], [token], [len(ids) + step])[0].argmax())
        assert cache.layers[0].keys.data_ptr() == pointer  # same buffer: one slot written, nothing copied
    assert cache.get_seq_length() == len(ids) + 8


def test_cache_grows_past_its_capacity_keeping_its_contents():
    keys, values = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4)  # [L, H, T, D]
    cache = BlendCache(keys.clone(), values.clone())
    new_k, new_v = torch.randn(1, 3, 2, 4), torch.randn(1, 3, 2, 4)
    k, v = cache.append(1, new_k, new_v)
    assert k.shape == (1, 3, 7, 4) and cache.layers[1].keys is k
    assert torch.equal(k[0, :, :5], keys[1]) and torch.equal(k[:, :, 5:], new_k) and torch.equal(v[:, :, 5:], new_v)
    assert cache._buffers[1][0].shape[2] >= 10  # doubled, so the next appends are writes
    assert cache.layers[0].keys.shape[2] == 5   # other layers untouched
