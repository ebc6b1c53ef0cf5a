"""The device seam: the CUDA backend's FlexAttention plan (run eagerly here) equals the dense masked reference,
and a Blender on it blends as on the CPU backend; the batched RoPE placement is bit-identical to the per-chunk shift."""
from __future__ import annotations

import pytest
import torch

from blend import Blender
from blend.attention import dense_attention
from blend.backend import Backend, CudaBackend, backend_for, flex_block_mask
from tests.blend.conftest import TEST_DEVICE, random_ids, tiny_model
from tests.blend.test_attention import CASES, qkv
from tests.blend.test_prefill import SUFFIX, segments

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # the CPU twin
FLEX_CASES = ["contiguous after a prefix", "queries equal keys", "one query", "scattered with suffix",
              "scattered from position 0", "scattered, sparse"]


def test_the_backend_is_chosen_by_device():
    assert type(backend_for(torch.device("cpu"))) is Backend
    assert isinstance(backend_for(torch.device("cuda")), CudaBackend)


@pytest.mark.parametrize("heads", [(9, 3), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("case", FLEX_CASES)
def test_flex_plan_equals_dense_masked_reference(case, heads):
    positions, num_keys = CASES[case]
    q, k, v = (t.to(TEST_DEVICE) for t in qkv(positions.numel(), num_keys + 5, heads))  # room past the prompt
    positions = positions.to(TEST_DEVICE)
    backend = CudaBackend(TEST_DEVICE)  # on the host: its plans, eagerly
    out = backend.plan(positions, num_keys=int(positions[-1]) + 1).attend(q, k, v, scale=0.1)
    reference = dense_attention(q, k, v, positions, scale=0.1)
    assert out.shape == (1, positions.numel(), heads[0], q.shape[-1])
    assert (out - reference).abs().max() < 1e-4


def test_flex_block_mask_skips_hidden_key_blocks():
    positions = torch.tensor([0, 1, 130, 300, 301, 640])  # one query block of 128
    mask = flex_block_mask(positions, 641)
    # fully visible: none before position 0's block; partly: blocks 0..5 (position 640 is in block 5)
    assert mask.full_kv_num_blocks.flatten().tolist() == [0]
    assert mask.kv_num_blocks.flatten().tolist() == [6]
    late = torch.arange(600, 700)                      # every query past keys 0..599
    mask = flex_block_mask(late, 700)
    assert mask.full_kv_num_blocks.flatten().tolist() == [4] and mask.kv_num_blocks.flatten().tolist() == [2]


@pytest.mark.parametrize("selection", ["query", "hkvd"])
def test_a_blender_on_the_flex_backend_blends_as_on_the_cpu(selection):
    blender = Blender(tiny_model("llama"), tokenizer=None, fingerprint="tiny-llama")
    segs = segments(blender)
    expected = blender.prefill(segs, SUFFIX, 0.3, selection=selection)
    blender.backend = CudaBackend(TEST_DEVICE)
    got = blender.prefill(segs, SUFFIX, 0.3, selection=selection)
    assert torch.equal(got.selected, expected.selected)
    assert (got.logits - expected.logits).abs().max() < 1e-4


def test_batched_placement_equals_the_per_chunk_shift_bit_for_bit():
    blender = Blender(tiny_model("qwen2").float(), tokenizer=None, fingerprint="tiny-qwen2")
    segs = segments(blender, conditioned=False)   # every chunk computed at 0, moved
    assembled = blender.prefill(segs, SUFFIX, 0.0).cache
    start = 0
    for seg in segs:
        for layer in range(blender.num_layers):
            per_chunk = blender.shifter.shift(seg.keys[layer], start - seg.position)   # [H, T, D]
            assert torch.equal(assembled.layers[layer].keys[0, :, start:start + seg.num_tokens], per_chunk)
            assert torch.equal(assembled.layers[layer].values[0, :, start:start + seg.num_tokens], seg.values[layer])
        start += seg.num_tokens


def test_rotation_for_many_deltas_equals_one_shift_each():
    blender = Blender(tiny_model("llama"), tokenizer=None, fingerprint="tiny-llama")
    keys = blender.precompute(random_ids(12, 3)).keys[2]                               # [H, T, D]
    deltas = torch.tensor([0, 0, 5, 5, 5, 40_000, 40_000, 40_000, -3, -3, 1, 1])
    cos, sin = blender.shifter.rotation(deltas, keys.dtype)
    out = torch.empty_like(keys)
    blender.shifter.place(out, keys, cos.to(keys.device), sin.to(keys.device))
    for t, delta in enumerate(deltas.tolist()):
        assert torch.equal(out[:, t], blender.shifter.shift(keys[:, t:t + 1], delta)[:, 0])


def test_the_backend_decides_what_the_device_changes():
    """Placement, key columns, graphs, the decode step's form: each decided by the backend, nowhere else."""
    from blend.batch import LayerStep
    from blend.kernel_step import KernelStep

    model = tiny_model("llama")
    cpu = backend_for(torch.device("cpu"))
    cpu.prepare(model, 16)
    placement = cpu.placement
    assert (placement.device.type, placement.on_host, placement.pin, placement.device_free_bytes) == ("cpu", True,
                                                                                                    False, 0)
    assert [cpu.key_columns(n, 2000) for n in (1, 256, 257, 1990)] == [256, 256, 512, 2000]
    assert not cpu.step_graphs("on").enabled and not cpu.step_graphs("auto").enabled
    form, reason = cpu.decode_step(model)
    assert isinstance(form, KernelStep if cpu.kernels else LayerStep) and (reason is None) == cpu.kernels
    cuda = CudaBackend(torch.device("cuda"))  # nothing is asked of a GPU until it is used
    assert [cuda.key_columns(n, 2000) for n in (1, 256, 257, 700, 1990)] == [256, 256, 512, 1024, 2000]
    assert isinstance(cuda.decode_step(model)[0], LayerStep)
    assert cuda.step_graphs("auto").enabled and not cuda.step_graphs("off").enabled


@pytest.mark.skipif(TEST_DEVICE.type != "cuda", reason="a GPU's placement")
def test_on_a_gpu_host_buffers_are_pinned_and_the_free_memory_is_known():
    placement = backend_for(TEST_DEVICE).placement
    assert placement.device == TEST_DEVICE and not placement.on_host and placement.pin
    assert placement.device_free_bytes > 0
