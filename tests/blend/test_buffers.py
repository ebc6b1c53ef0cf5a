"""The CPU backend's recycled prompt buffers: a free buffer is handed out again (no fresh pages per prompt),
one still referenced never is, and a Blender's prefill left alive is untouched by the next prefills."""
from __future__ import annotations

import torch

from blend import Blender
from blend.buffers import BufferRecycler
from tests.blend.conftest import tiny_model
from tests.blend.test_prefill import SUFFIX, segments


def test_a_freed_buffer_is_handed_out_again_for_any_size_that_fits():
    recycler = BufferRecycler()
    first = recycler.empty((4, 100, 8), torch.float32)
    address = first.data_ptr()
    del first
    again = recycler.empty((4, 90, 8), torch.float32)    # smaller: the same memory
    assert again.data_ptr() == address and again.shape == (4, 90, 8) and again.is_contiguous()
    other_dtype = recycler.empty((4, 90, 8), torch.bfloat16)
    assert other_dtype.data_ptr() != address


def test_a_buffer_still_referenced_is_never_handed_out_twice():
    recycler = BufferRecycler()
    held = recycler.empty((2, 64), torch.float32)
    views = [held[:, :10], held.detach(), held.view(-1)]
    del held
    for alias in views:   # any alias of its storage keeps it in use
        fresh = recycler.empty((2, 64), torch.float32)
        assert fresh.data_ptr() != alias.data_ptr()
        fresh.fill_(1.0)
        alias.fill_(2.0)
        assert bool((fresh == 1.0).all())
    del fresh, views, alias
    assert len({recycler.empty((2, 64), torch.float32).data_ptr() for _ in range(3)}) == 1  # all free again


def test_it_keeps_at_most_its_cap_and_lets_go_of_free_buffers_first():
    recycler = BufferRecycler(keep=2)
    in_use = recycler.empty((1000,), torch.float32)
    recycler.empty((1000,), torch.float32)       # freed at once
    recycler.empty((5000,), torch.float32)       # no free one fits: the free 1000 goes, the one in use stays
    assert recycler.retained_bytes <= (1024 + 5120) * 4
    assert in_use.data_ptr() in {flat.data_ptr() for flat, _ in recycler._buffers}


def test_a_live_prefill_keeps_its_cache_while_later_prefills_reuse_memory():
    blender = Blender(tiny_model("llama"), tokenizer=None, fingerprint="tiny-llama")
    segs = segments(blender)
    kept = blender.prefill(segs, SUFFIX, 0.3)
    snapshot = [(layer.keys.clone(), layer.values.clone()) for layer in kept.cache.layers]
    addresses = set()
    for ratio in (0.0, 1.0, 0.5, 0.0):  # each result dropped at once: their buffers recycle
        addresses.add(blender.prefill(segs, SUFFIX, ratio).cache.layers[0].keys.data_ptr())
    assert kept.cache.layers[0].keys.data_ptr() not in addresses
    assert len(addresses) < 4   # memory was reused between the later prefills
    for layer, (keys, values) in zip(kept.cache.layers, snapshot):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
