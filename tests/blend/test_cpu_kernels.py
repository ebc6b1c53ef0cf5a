"""The CPU kernels: the decode attention gives each row's queries over its own keys as sdpa does, reading
nothing past a row's length; the linears give x @ Wᵀ; a row's result is the same bit for bit whatever else the
step holds; the prefill attention gives queries at any sorted positions what the masked reference gives,
reading no key past the last position; the Blender prefills and decodes the same tokens through them as
without them; they are torch ops (torch.ops.ragblend) whose schemas, fake implementations and checks hold;
without a compiler it falls back to sdpa and MKL, with the reason."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from blend import Blender, DecodeRuntime, SamplingParams, cpu_kernels
from blend.attention import AttentionPlan, dense_attention
from blend.backend import KernelPlan
from blend.quantized import quantize
from blend.skinny import SkinnyLinear
from tests.blend.conftest import TEST_DEVICE, random_ids, tiny_model
from tests.blend.test_attention import scattered

# The kernel is the CPU's: on a GPU test run (bench/device_check.sh) these are not its business.
pytestmark = pytest.mark.skipif(TEST_DEVICE.type != "cpu", reason="the CPU kernels")
needs_kernel = pytest.mark.skipif(None in (shutil.which(os.environ.get("CXX", "c++")), shutil.which("ninja")),
                                  reason="no C++ compiler or no ninja to build the kernels")

LENGTHS = [1, 255, 256, 257, 700, 0, 3]  # around the kernel's 256-key chunks; 0 is a padding row


def pool_rows(lengths: list[int], heads: int, dim: int, columns: int = 768, seed: int = 0):
    """K and V as the decode step sees them: views [rows, H, columns, D] of a pool with a spare slot, NaN past
    each row's length (memory no step has written)."""
    generator = torch.Generator().manual_seed(seed)
    pools = [torch.randn(len(lengths) + 1, heads, columns, dim, generator=generator) for _ in range(2)]
    for pool in pools:
        for row, length in enumerate(lengths):
            pool[row, :, length:] = float("nan")
    return [pool[: len(lengths)] for pool in pools]


def sdpa_reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: list[int]):
    out = torch.zeros_like(query)
    for row, length in enumerate(lengths):
        if length:
            out[row] = F.scaled_dot_product_attention(query[row: row + 1], keys[row: row + 1, :, :length],
                                                      values[row: row + 1, :, :length])[0]
    return out


@needs_kernel
@pytest.mark.parametrize("heads, group, dim", [(3, 3, 64), (2, 4, 128), (1, 1, 16), (2, 3, 12)])
def test_kernel_equals_sdpa_over_each_rows_own_keys(heads, group, dim):
    assert cpu_kernels.load() is not None, cpu_kernels.unavailable()
    keys, values = pool_rows(LENGTHS, heads, dim)
    query = torch.randn(len(LENGTHS), heads, group, dim, generator=torch.Generator().manual_seed(1))
    out = cpu_kernels.decode_attention(query, keys, values, torch.tensor(LENGTHS))
    assert torch.isfinite(out).all()  # the NaN past each row's length was never read
    assert torch.allclose(out, sdpa_reference(query, keys, values, LENGTHS), atol=1e-5, rtol=1e-4)
    assert out[LENGTHS.index(0)].eq(0).all()


@needs_kernel
def test_a_rows_result_does_not_depend_on_the_steps_other_rows():
    assert cpu_kernels.load() is not None, cpu_kernels.unavailable()
    keys, values = pool_rows(LENGTHS, 3, 64)
    query = torch.randn(len(LENGTHS), 3, 3, 64, generator=torch.Generator().manual_seed(2))
    together = cpu_kernels.decode_attention(query, keys, values, torch.tensor(LENGTHS))
    for row, length in enumerate(LENGTHS):
        alone = cpu_kernels.decode_attention(query[row: row + 1], keys[row: row + 1], values[row: row + 1],
                                               torch.tensor([length]))
        assert torch.equal(alone[0], together[row]), f"row {row}"


@needs_kernel
@pytest.mark.parametrize("features", [576, 12])  # the vector loop, and its scalar tail
def test_linear_rows_equal_the_matmul_and_each_row_alone(features):
    assert cpu_kernels.load() is not None, cpu_kernels.unavailable()
    generator = torch.Generator().manual_seed(3)
    weight, x = torch.randn(193, features, generator=generator), torch.randn(8, features, generator=generator)
    together = cpu_kernels.linear_rows(x, weight)
    assert torch.allclose(together, x @ weight.t(), atol=1e-4, rtol=1e-5)
    for rows in range(1, 9):  # every row count the kernel is built for: row 0 the same bit for bit
        assert torch.equal(cpu_kernels.linear_rows(x[:rows], weight)[0], together[0]), f"{rows} rows"
    with pytest.raises(ValueError, match="1..8 rows"):
        cpu_kernels.linear_rows(torch.randn(9, features), weight)


@needs_kernel
def test_linear_rows_many_gives_each_matrix_what_linear_rows_gives():
    """Matrices apart in memory, sizes that split unevenly between the threads: each block of the output is
    that matrix's linear_rows, bit for bit, at every row count."""
    assert cpu_kernels.load() is not None, cpu_kernels.unavailable()
    generator = torch.Generator().manual_seed(4)
    weights = [torch.randn(n, 96, generator=generator) for n in (40, 7, 129)]
    for rows in (1, 3, 8):
        x = torch.randn(rows, 96, generator=generator)
        out = cpu_kernels.linear_rows_many(x, weights)
        assert out.shape == (rows, 176)
        for block, weight in zip(out.split([40, 7, 129], dim=1), weights):
            assert torch.equal(block, cpu_kernels.linear_rows(x, weight)), f"{rows} rows"
    with pytest.raises(ValueError, match="contiguous"):
        cpu_kernels.linear_rows_many(torch.randn(2, 96), [weights[0], torch.randn(96, 5).t()])


@needs_kernel
@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (4, 4, 16)])
def test_rope_write_rotates_as_hf_does_and_writes_each_row_at_its_position(heads, kv_heads, dim):
    """The same bits as HF's apply_rotary_pos_emb; row r's rotated keys and its values land in slot r at
    positions[r] (a padding row's at the scratch column), nothing else in the pool changes."""
    assert cpu_kernels.load() is not None, cpu_kernels.unavailable()
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    generator = torch.Generator().manual_seed(5)
    rows, positions = 3, torch.tensor([5, 0, 63])
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=generator)   # one buffer: strided q, k, v
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
    angles = torch.rand(rows, dim // 2, generator=generator) * 40
    cos, sin = torch.cat([angles, angles], 1).cos(), torch.cat([angles, angles], 1).sin()
    pool_k, pool_v = (torch.randn(4, kv_heads, 64, dim, generator=generator) for _ in range(2))
    before_k, before_v = pool_k.clone(), pool_v.clone()
    query = cpu_kernels.rope_write(q, k, v, cos, sin, positions, pool_k, pool_v)
    want_q, want_k = apply_rotary_pos_emb(q.view(rows, heads, 1, dim), k.view(rows, kv_heads, 1, dim),
                                          cos[:, None], sin[:, None])
    assert torch.equal(query, want_q[:, :, 0])
    for r, p in enumerate(positions.tolist()):
        assert torch.equal(pool_k[r, :, p], want_k[r, :, 0]) and torch.equal(pool_v[r, :, p], v[r].view(kv_heads, dim))
        before_k[r, :, p], before_v[r, :, p] = pool_k[r, :, p], pool_v[r, :, p]
    assert torch.equal(pool_k, before_k) and torch.equal(pool_v, before_v)  # nothing else written
    with pytest.raises(ValueError, match="outside the pool"):
        cpu_kernels.rope_write(q, k, v, cos, sin, torch.tensor([5, 0, 64]), pool_k, pool_v)


@needs_kernel
@pytest.mark.parametrize("dim", [64, 12])  # the vector loops, and the scalar ones
def test_a_float16_pool_is_read_and_written_as_the_same_floats(dim):
    """The decode pool in float16 (blend.kernel_step's): attention over it is attention over its values as float32,
    bit for bit, and rope_write stores what it writes into a float32 pool, rounded to the nearest half."""
    assert cpu_kernels.load() is not None, cpu_kernels.unavailable()
    keys, values = (part.half() for part in pool_rows(LENGTHS, 3, dim))
    query = torch.randn(len(LENGTHS), 3, 2, dim, generator=torch.Generator().manual_seed(7))
    lengths = torch.tensor(LENGTHS)
    assert torch.equal(cpu_kernels.decode_attention(query, keys, values, lengths),
                       cpu_kernels.decode_attention(query, keys.float(), values.float(), lengths))
    generator = torch.Generator().manual_seed(8)
    qkv = torch.randn(2, 5 * dim, generator=generator)  # 3 query heads, 1 KV head
    angles = torch.rand(2, dim // 2, generator=generator) * 40
    cos, sin = torch.cat([angles, angles], 1).cos(), torch.cat([angles, angles], 1).sin()
    pools = {dtype: [torch.zeros(3, 1, 16, dim, dtype=dtype) for _ in range(2)] for dtype in (torch.float16,
                                                                                             torch.float32)}
    queries = [cpu_kernels.rope_write(*qkv.split([3 * dim, dim, dim], dim=1), cos, sin, torch.tensor([4, 15]), *pool)
               for pool in pools.values()]
    assert torch.equal(queries[0], queries[1])
    for half, single in zip(*pools.values()):
        assert torch.equal(half, single.half()) and half.abs().sum() > 0


@needs_kernel
def test_the_kernels_refuse_what_they_cannot_read_in_place():
    assert cpu_kernels.load() is not None, cpu_kernels.unavailable()
    keys, values = pool_rows([4], 2, 8)
    query = torch.randn(1, 2, 2, 8)
    with pytest.raises(TypeError, match="float32"):
        cpu_kernels.decode_attention(query.double(), keys, values, torch.tensor([4]))
    with pytest.raises(ValueError, match="in place"):
        cpu_kernels.decode_attention(query, keys.transpose(2, 3), values, torch.tensor([4]))
    with pytest.raises(ValueError, match="over a view of 768"):
        cpu_kernels.decode_attention(query, keys, values, torch.tensor([769]))


PREFILL_CASES = {  # around the kernel's 32-query tasks and 64-key blocks
    "scattered with suffix": (scattered(200, 1400, 0.15, 20), 1500),
    "scattered from position 0": (scattered(0, 300, 0.3, 0), 300),
    "queries equal keys": (torch.arange(0, 130), 130),
    "contiguous after a prefix": (torch.arange(63, 129), 200),
    "one query at position 0": (torch.tensor([0]), 10),
    "one query per block": (torch.arange(5, 1000, 64), 1000),
}


@needs_kernel
@pytest.mark.parametrize("heads, dim", [((9, 3), 64), ((8, 2), 128), ((4, 4), 16)], ids=["gqa", "d128", "mha"])
@pytest.mark.parametrize("case", sorted(PREFILL_CASES))
def test_prefill_kernel_equals_the_masked_reference(case, heads, dim):
    assert cpu_kernels.load() is not None, cpu_kernels.unavailable()
    positions, num_keys = PREFILL_CASES[case]
    generator = torch.Generator().manual_seed(4)
    # queries as a layer makes them ([B, T, H, D] transposed); keys peaky, so a masking error shows
    query = torch.randn(1, positions.numel(), heads[0], dim, generator=generator).transpose(1, 2)
    keys = torch.randn(1, heads[1], num_keys, dim, generator=generator) * 2
    values = torch.randn(1, heads[1], num_keys, dim, generator=generator)
    reference = dense_attention(query, keys, values, positions)
    last = int(positions[-1])
    keys[:, :, last + 1:], values[:, :, last + 1:] = float("nan"), float("nan")  # never read
    out = cpu_kernels.prefill_attention(query, keys, values, positions)
    assert out.shape == (1, positions.numel(), heads[0], dim)
    assert (out - reference).abs().max() < 1e-4


@needs_kernel
def test_the_prefill_kernel_refuses_what_it_cannot_take():
    assert cpu_kernels.load() is not None, cpu_kernels.unavailable()
    query, keys = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 10, 16)
    positions = torch.tensor([2, 5, 9])
    with pytest.raises(ValueError, match="strictly increasing"):
        cpu_kernels.prefill_attention(query, keys, keys, torch.tensor([2, 9, 5]))
    with pytest.raises(ValueError, match="over 10 keys"):
        cpu_kernels.prefill_attention(query, keys, keys, torch.tensor([2, 5, 10]))
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu_kernels.prefill_attention(query[..., :12], keys[..., :12], keys[..., :12], positions)
    with pytest.raises(ValueError, match="one prompt"):
        cpu_kernels.prefill_attention(query.expand(2, -1, -1, -1), keys.expand(2, -1, -1, -1),
                                      keys.expand(2, -1, -1, -1), positions)
    with pytest.raises(TypeError, match="float32"):
        cpu_kernels.prefill_attention(query.double(), keys, keys, positions)


@needs_kernel
@pytest.mark.parametrize("head_dim, kernel", [(16, True), (8, False)])
def test_the_blenders_prefill_attention_is_the_kernel_where_the_head_size_suits_it(head_dim, kernel):
    model = tiny_model("llama", num_attention_heads=64 // head_dim, num_key_value_heads=64 // head_dim // 2)
    blender = Blender(model, tokenizer=None, fingerprint="tiny-llama")
    assert isinstance(blender.backend.plan(torch.tensor([3, 8])), KernelPlan if kernel else AttentionPlan)


@needs_kernel
def test_the_blender_prefills_the_same_as_without_the_kernels():
    head, chunks, suffix = random_ids(12, 40), [random_ids(70, 41), random_ids(90, 42)], random_ids(9, 43)
    results = {}
    for setting in ("auto", "off"):
        blender = Blender(tiny_model("llama"), tokenizer=None, fingerprint="tiny-llama", cpu_kernel=setting)
        expected_plan = KernelPlan if setting == "auto" else AttentionPlan
        assert isinstance(blender.backend.plan(torch.tensor([1, 4])), expected_plan)
        segments = [blender.precompute(head)] + [blender.precompute(ids, head) for ids in chunks]
        results[setting] = [blender.prefill(segments, suffix, ratio) for ratio in (0.0, 0.3, 1.0)]
    for auto, off in zip(results["auto"], results["off"]):
        assert torch.equal(auto.selected, off.selected)
        assert torch.allclose(auto.logits, off.logits, atol=1e-4, rtol=1e-4)
        assert int(auto.logits.argmax()) == int(off.logits.argmax())


@needs_kernel
def test_the_blender_decodes_the_same_tokens_through_the_kernels_as_without():
    prompts = [random_ids(13, 31), random_ids(40, 32), random_ids(7, 33)]
    tokens = {}
    for setting in ("auto", "off"):
        blender = Blender(tiny_model("llama"), tokenizer=None, fingerprint="tiny-llama", cpu_kernel=setting)
        decoder = DecodeRuntime(blender, slots=4, max_len=96)
        assert blender.cpu_kernels == (setting == "auto")
        linears = [m for m in blender.model.modules() if isinstance(m, SkinnyLinear)]
        assert linears and all(m.kernel == (setting == "auto") for m in linears)
        sequences = [decoder.start(blender.full_prefill(ids), SamplingParams(10)) for ids in prompts]
        rows = [[int(blender.full_prefill(ids).logits.argmax())] for ids in prompts]
        for _ in range(9):
            following = decoder.step(sequences, [r[-1] for r in rows], [s.length for s in sequences])
            for row, token in zip(rows, following):
                row.append(token)
        tokens[setting] = rows
    assert tokens["auto"] == tokens["off"]


def op_samples() -> dict[str, tuple]:
    """Small arguments for each op, laid out as its callers lay them (pool views, strided q/k/v)."""
    generator = torch.Generator().manual_seed(6)
    pool = torch.randn(4, 2, 40, 16, generator=generator)
    qkv = torch.randn(3, 6 * 16, generator=generator)  # 2 query heads, 2 KV heads
    angles = torch.rand(3, 8, generator=generator)
    cos, sin = torch.cat([angles, angles], 1).cos(), torch.cat([angles, angles], 1).sin()
    weights = [torch.randn(n, 24, generator=generator) for n in (5, 7)]
    return {
        "decode_attention": (torch.randn(3, 2, 2, 16, generator=generator), pool[:3], pool[1:],
                             torch.tensor([5, 0, 40]), None),
        "linear_rows": (torch.randn(3, 24, generator=generator), weights[0]),
        "linear_rows_many": (torch.randn(2, 24, generator=generator), weights),
        "quantized_rows": (torch.randn(2, 64, generator=generator),
                           [quantize(torch.randn(n, 64), 4)[0] for n in (5, 7)],
                           [torch.rand(n, 2) for n in (5, 7)], [torch.randn(n, 2) for n in (5, 7)]),
        "rope_write": (*qkv.split([32, 32, 32], dim=1), cos, sin, torch.tensor([3, 0, 39]), pool.clone(), pool.clone()),
        "prefill_attention": (torch.randn(1, 3, 4, 16, generator=generator).transpose(1, 2), pool[:1], pool[1:2],
                              torch.tensor([2, 5, 9]), 0.3),
        # a layer of hidden 32: 2 query and 2 KV heads of 16, an MLP of 48; its pool in float16
        "decode_layer": (torch.randn(3, 32, generator=generator), torch.rand(32), torch.rand(32), 1e-5,
                         [torch.randn(32, 32, generator=generator) for _ in range(3)], [torch.randn(32, 32)],
                         [torch.randn(48, 32) for _ in range(2)], [torch.randn(32, 48)], [None, None, None, None],
                         32, 32, cos, sin, torch.tensor([3, 0, 39]), torch.tensor([4, 1, 40]),
                         pool.clone().half(), pool.clone().half(), 40, 0.25),
        # a layer's K/V [1, H, N, D] (a view of a longer buffer), three spans to round trip in place
        "int8_round_trip": (torch.randn(1, 2, 48, 16, generator=generator)[:, :, :40],
                            torch.randn(1, 2, 40, 16, generator=generator), torch.tensor([[0, 7], [9, 30], [30, 31]])),
    }


@needs_kernel
@pytest.mark.parametrize("name", sorted(op_samples()))
def test_each_kernel_is_a_torch_op_whose_schema_and_fake_form_hold(name):
    """torch.library.opcheck: the schema states what the op mutates, the fake form gives the real output's
    shapes, dtypes and strides (FakeTensor), and the op traces through AOT dispatch with dynamic shapes."""
    assert cpu_kernels.load() is not None, cpu_kernels.unavailable()
    torch.library.opcheck(getattr(torch.ops.ragblend, name).default, op_samples()[name])


@needs_kernel
def test_the_profiler_sees_the_kernels_as_ops():
    assert cpu_kernels.load() is not None, cpu_kernels.unavailable()
    x, weight = op_samples()["linear_rows"]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        cpu_kernels.linear_rows(x, weight)
    assert "ragblend::linear_rows" in {event.name for event in profile.events()}


@needs_kernel
def test_the_ops_check_what_they_read_however_they_are_called():
    assert cpu_kernels.load() is not None, cpu_kernels.unavailable()
    query, keys, values, lengths, _ = op_samples()["decode_attention"]
    with pytest.raises(ValueError, match="a row of -1 keys"):
        torch.ops.ragblend.decode_attention(query, keys, values, torch.tensor([5, -1, 40]))
    with pytest.raises(ValueError, match="expected 3 lengths"):
        torch.ops.ragblend.decode_attention(query, keys, values, lengths[:2])
    with pytest.raises(ValueError, match="disagree"):
        torch.ops.ragblend.decode_attention(query[:, :1], keys, values, lengths)
    q, k, v, cos, sin, positions, pool_keys, pool_values = op_samples()["rope_write"]
    with pytest.raises(ValueError, match="expected 3 positions"):
        torch.ops.ragblend.rope_write(q, k, v, cos, sin, positions[:2], pool_keys, pool_values)
    with pytest.raises(ValueError, match="do not fit"):
        torch.ops.ragblend.rope_write(q, k, v, cos, sin, positions, pool_keys, pool_values[:, :1])


FALLBACK = """
import json
from blend import Blender, DecodeRuntime, SamplingParams, cpu_kernels
from tests.blend.conftest import random_ids, tiny_model
blender = Blender(tiny_model("llama"), tokenizer=None, fingerprint="tiny-llama")
decoder = DecodeRuntime(blender, slots=2, max_len=64)
assert not blender.cpu_kernels
tokens = list(decoder.generate(blender.full_prefill(random_ids(9, 34)), SamplingParams(6)))
print(json.dumps({"tokens": len(tokens), "reason": cpu_kernels.unavailable()}))
"""


@pytest.mark.parametrize("compiler", ["missing", "failing"])
def test_without_a_working_compiler_the_decode_step_uses_sdpa_and_mkl_with_the_reason(tmp_path, compiler):
    """In a process of its own (a process loads the ops once): the build fails, the reason is kept, one warning
    is all the build prints, and the Blender decodes through sdpa and MKL."""
    script = tmp_path / "c++"  # answers --version, fails to compile
    script.write_text('#!/bin/sh\n[ "$1" = --version ] && echo "c++ 0.1" && exit 0\n'
                      'echo "c++: out of luck" >&2\nexit 1\n')
    script.chmod(0o755)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "CXX": str(script) if compiler == "failing" else "/nonexistent/c++",
           "RAGBLEND_KERNEL_DIR": str(tmp_path / "kernels"), "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", FALLBACK], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["tokens"] == 6
    assert ("out of luck" if compiler == "failing" else "/nonexistent/c++") in result["reason"]
    assert done.stderr.strip() == "no CPU kernels; decode steps and prefills use torch's sdpa and MKL"
    assert not list((tmp_path / "kernels").glob("**/*"))  # nothing half-built left behind


@needs_kernel
def test_the_kernels_benchmark_runs_and_the_ops_give_the_old_librarys_bits():
    """bench/kernels.py at small sizes: every case timed; where git has the ctypes library these ops replaced,
    each op's outputs equal its outputs bit for bit (the same sums in the same order on every thread), but decode
    attention's, whose products and sums are fused now."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "bench/kernels.py", "--rounds", "1", "--layers", "1", "--keys", "300",
                           "--prefill-keys", "300", "--queries", "40"], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(root)}, timeout=600)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    cases = {"decode_attention", "linear_rows_1", "linear_rows_4", "linear_rows_8", "rope_write", "prefill_attention",
             "prefill_linears_3100", "prefill_linears_470"}
    assert set(report["median_ms"]["new"]) == cases
    if report["old"]:
        # decode attention fuses its multiply-adds now (rounded once): its sums, not the old ones
        kernels = cases - {"prefill_linears_3100", "prefill_linears_470"}
        assert report["same_bits"] == {**dict.fromkeys(kernels, True), "decode_attention": False}
