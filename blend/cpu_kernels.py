"""Attention and few-row linears on the CPU as small C kernels (kernels/cpu_kernels.c), built once per machine
with the system's C compiler and called through ctypes.

A decode step streams every weight and each row's K/V from memory for little arithmetic, and torch's CPU
kernels do that at a fraction of the machine's bandwidth (2 cores, ~25 GB/s here):

- `decode_attention`: sdpa runs a step's few queries per KV head (the query heads sharing it) as tiny GEMMs
  over 512-key blocks: one SmolLM2 layer, 4 rows of 2.5k keys, 1.6 ms against 0.6 ms to read its K/V once.
  The kernel reads each row's keys once, up to its own length, prefetching the next task's while it works on
  its own from cache: all 30 layers, 4 rows 50 → 28 ms, 1 row 16 → 8 ms (at 3.2k keys, 31 → 27 ms for 4 rows
  with the prefetch).
- `linear_rows`: MKL runs one row as a GEMV on one thread, and 2–16 rows, even as (W @ xᵀ)ᵀ (blend.skinny),
  at ~14 GB/s. The kernel streams the weights once over both threads: all linears + the LM head, 1 row
  38 → 24 ms, 4 rows 40 → 28 ms, 8 rows 56 → 34 ms.
  `linear_rows_many` runs a layer's projections of one input in one call, its threads each taking an equal run
  of the outputs as if the weights were one matrix: 30 layers' q/k/v 4.8 → 3.5-4 ms.
- `rope_write`: RoPE on a step's new queries and keys in HF's rotate-half form (the same bits) and the keys
  and values written into the pool, one call a layer in place of ~14 small ops (blend.kernel_step).

Each row's result depends on its own inputs only, never on the step's other rows (nor on the masked columns
after a row's length), so a request decodes the same tokens alone or batched.

A blended prefill's attention is compute-bound instead: a few hundred queries at scattered positions over the
whole prompt. torch's CPU flash kernel (blend.attention's planned pieces) runs it at ~67 GFLOP/s here;
`prefill_attention` is flash attention over each query's own keys [0, position] with register-tiled
products (fused multiply-adds: a prefill runs alone): one SmolLM2 layer, 405 queries over 3.1k keys,
27.9 → 16.6 ms (107 useful GFLOP/s).

The library is compiled with `-march=native` (this machine's vectors) into a per-user cache, named by a
hash of the source, the compiler and the CPU, written by atomic rename (processes may build it at once).
Without a compiler, or when the build fails, `load()` returns None with the reason in `unavailable()`,
and decode steps and prefills use torch's sdpa and MKL instead.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Sequence

import torch

log = logging.getLogger("ragblend.blend")

SOURCE = Path(__file__).with_name("kernels") / "cpu_kernels.c"
LINEAR_ROWS = 8  # linear_rows takes 1..this many rows
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_reason: str | None = None  # why there is no library (None: built, or not tried yet)


def cache_dir() -> Path:
    """Where built kernels live: $RAGBLEND_KERNEL_DIR, else the user's cache (~/.cache/ragblend/kernels)."""
    if configured := os.environ.get("RAGBLEND_KERNEL_DIR"):
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ragblend" / "kernels"


def _compiler_identity(compiler: str) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30, check=True)
    cpu = ""
    if Path("/proc/cpuinfo").exists():  # -march=native: a cached build is for this CPU's instruction set
        cpu = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    return "\n".join([version.stdout, platform.machine(), cpu, " ".join(FLAGS)])


def _build() -> ctypes.CDLL:
    compiler = os.environ.get("CC", "cc")
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + _compiler_identity(compiler).encode()).hexdigest()[:16]
    target = cache_dir() / f"cpu_kernels-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            done = subprocess.run([compiler, *FLAGS, "-o", str(built), str(SOURCE), "-lm"], capture_output=True,
                                  text=True, timeout=120)
            if done.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
            os.replace(built, target)
        log.info("built the CPU kernels", extra={"path": str(target)})
    library = ctypes.CDLL(str(target))
    library.decode_attention.restype = ctypes.c_int
    library.decode_attention.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 8 + [ctypes.c_float, ctypes.c_int]
    library.linear_rows.restype = ctypes.c_int
    library.linear_rows.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    library.linear_rows_many.restype = ctypes.c_int
    library.linear_rows_many.argtypes = ([ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_void_p]
                                         + [ctypes.c_int64] * 2 + [ctypes.c_int])
    library.rope_write.restype = None
    library.rope_write.argtypes = [ctypes.c_void_p] * 9 + [ctypes.c_int64] * 8
    library.prefill_attention.restype = ctypes.c_int
    library.prefill_attention.argtypes = ([ctypes.c_void_p] * 5 + [ctypes.c_int64] * 8
                                          + [ctypes.c_float, ctypes.c_int])
    return library


def load() -> ctypes.CDLL | None:
    """The built kernels' library, building it at the first call; None (reason logged once) if it cannot be."""
    global _library, _reason
    with _lock:
        if _library is None and _reason is None:
            try:
                _library = _build()
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                _reason = f"{type(exc).__name__}: {exc}"
                log.warning("no CPU kernels; decode steps and prefills use torch's sdpa and MKL",
                            extra={"reason": _reason})
        return _library


def unavailable() -> str | None:
    """Why `load()` gave no kernels (None: it gave them, or was not called yet)."""
    return _reason


def decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """query [rows, Hkv, G, D] (the G query heads of each KV head) over keys/values [rows, Hkv, T, D] (views of
    the pool, each key's D floats contiguous) up to lengths [rows] (int64; 0 for a padding row, whose output is zeros);
    returns [rows, Hkv, G, D]. float32 on the CPU; `load()` must have given a library."""
    rows, heads, group, dim = query.shape
    _check_float32(query, keys, values)
    if keys.stride()[2:] != (dim, 1) or values.stride()[2:] != (dim, 1):
        raise ValueError("the kernel reads each row's keys as [T, D] rows in place: got strides "
                         f"{keys.stride()} and {values.stride()}")
    if int(lengths.max()) > keys.shape[2]:
        raise ValueError(f"a row of {int(lengths.max())} keys over a view of {keys.shape[2]}")
    query, lengths = query.contiguous(), lengths.to(torch.int64).contiguous()
    out = torch.empty_like(query)
    status = _library.decode_attention(
        query.data_ptr(), keys.data_ptr(), values.data_ptr(), lengths.data_ptr(), out.data_ptr(),
        rows, heads, group, dim, keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        dim ** -0.5 if scale is None else scale, torch.get_num_threads())
    if status != 0:
        raise MemoryError("the CPU decode attention kernel could not allocate its work buffers")
    return out


def linear_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [rows, in] (1..LINEAR_ROWS rows) @ weight [out, in]ᵀ → [rows, out], float32 on the CPU."""
    rows, features = _check_rows("linear_rows", x, [weight])
    x = x.contiguous()
    out = x.new_empty(rows, weight.shape[0])
    _library.linear_rows(x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, weight.shape[0], features,
                         torch.get_num_threads())
    return out


def linear_rows_many(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """x [rows, in] (1..LINEAR_ROWS rows) @ [w₀; w₁; ..]ᵀ → [rows, Σ out]: the weights [out_m, in] wherever each
    lies in memory (nothing is copied), their outputs side by side, each as linear_rows gives it, in one call
    that streams them as if they were one matrix (a layer's q/k/v, or gate/up)."""
    rows, features = _check_rows("linear_rows_many", x, weights)
    x, count, sizes = x.contiguous(), len(weights), [w.shape[0] for w in weights]
    out = x.new_empty(rows, sum(sizes))
    _library.linear_rows_many(x.data_ptr(), (ctypes.c_void_p * count)(*(w.data_ptr() for w in weights)),
                              (ctypes.c_int64 * count)(*sizes), count, out.data_ptr(), rows, features,
                              torch.get_num_threads())
    return out


def _check_rows(kernel: str, x: torch.Tensor, weights: Sequence[torch.Tensor]) -> tuple[int, int]:
    """(rows, in) of x [rows, in] after checking what the linear kernels take: 1..LINEAR_ROWS float32 rows and
    contiguous float32 [out, in] weights on the CPU."""
    rows, features = x.shape
    _check_float32(x, *weights)
    if not 1 <= rows <= LINEAR_ROWS or any(w.shape[1] != features or not w.is_contiguous() for w in weights):
        raise ValueError(f"{kernel} takes 1..{LINEAR_ROWS} rows and contiguous [out, {features}] weights, got "
                         f"{rows} rows and {[tuple(w.shape) for w in weights]}")
    return rows, features


def rope_write(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               positions: torch.Tensor, pool_keys: torch.Tensor, pool_values: torch.Tensor) -> torch.Tensor:
    """A decode step's new tokens, query [rows, Hq·D], key and value [rows, Hkv·D] (rows of D-float heads; row
    strides free): RoPE on the queries and keys (HF's rotate-half form, the same bits), the rotated keys and the
    values written into one pool layer, pool_keys/pool_values [slots, Hkv, columns, D], row r at slot r and
    column positions[r] [rows]. cos, sin [rows, D]. Returns the rotated queries [rows, Hq, D]."""
    rows, dim = cos.shape
    heads, kv_heads = query.shape[1] // dim, pool_keys.shape[1]
    _check_float32(query, key, value, cos, sin, pool_keys, pool_values)
    if (query.stride(1), key.stride(1), value.stride(1)) != (1, 1, 1) or key.stride(0) != value.stride(0) \
            or key.shape[1] != kv_heads * dim or pool_keys.stride() != pool_values.stride() \
            or pool_keys.stride()[2:] != (dim, 1) or rows > pool_keys.shape[0]:
        raise ValueError(f"rope_write: query {tuple(query.shape)}, key {tuple(key.shape)} and pool "
                         f"{tuple(pool_keys.shape)} do not fit heads of {dim}")
    low, high = torch.aminmax(positions)
    if int(low) < 0 or int(high) >= pool_keys.shape[2]:
        raise ValueError(f"positions outside the pool's {pool_keys.shape[2]} columns")
    cos, sin, positions = cos.contiguous(), sin.contiguous(), positions.to(torch.int64).contiguous()
    out = query.new_empty(rows, heads, dim)
    _library.rope_write(query.data_ptr(), key.data_ptr(), value.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                        positions.data_ptr(), out.data_ptr(), pool_keys.data_ptr(), pool_values.data_ptr(), rows,
                        heads, kv_heads, dim, query.stride(0), key.stride(0), pool_keys.stride(0),
                        pool_keys.stride(1))
    return out


PREFILL_DIM_MULTIPLE = 16  # prefill_attention's head sizes: its tiles are two vectors of 8 floats wide


def prefill_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                      scale: float | None = None) -> torch.Tensor:
    """Causal attention of one prompt's queries at sorted absolute `positions` [Tq] over its keys at positions
    0..: query [1, Hq, Tq, D], keys/values [1, Hkv, Tk, D] (Tk > positions[-1]; each key's D floats contiguous;
    keys after the last position are never read) → [1, Tq, Hq, D]. float32 on the CPU, D a multiple of
    PREFILL_DIM_MULTIPLE; `load()` must have given a library."""
    batch, heads, count, dim = query.shape
    _check_float32(query, keys, values)
    if batch != 1 or keys.shape[0] != 1 or heads % keys.shape[1] or dim % PREFILL_DIM_MULTIPLE:
        raise ValueError(f"prefill_attention takes one prompt, whole groups of query heads and a head size that is "
                         f"a multiple of {PREFILL_DIM_MULTIPLE}: got query {tuple(query.shape)}, keys "
                         f"{tuple(keys.shape)}")
    if query.stride(3) != 1 or keys.stride()[2:] != (dim, 1) or values.stride()[2:] != (dim, 1):
        raise ValueError("the kernel reads queries, keys and values as rows of D floats in place: got strides "
                         f"{query.stride()}, {keys.stride()} and {values.stride()}")
    positions = positions.to(torch.int64).contiguous()
    if positions.numel() != count or count == 0 or int(positions[-1]) >= keys.shape[2]:
        raise ValueError(f"{count} queries at {positions.numel()} positions over {keys.shape[2]} keys")
    if positions[0] < 0 or bool((positions[1:] <= positions[:-1]).any()):  # its tasks read keys by the last
        raise ValueError("query positions must be non-negative and strictly increasing")
    out = query.new_empty(1, count, heads, dim)
    status = _library.prefill_attention(
        query.data_ptr(), keys.data_ptr(), values.data_ptr(), positions.data_ptr(), out.data_ptr(), count,
        keys.shape[1], heads // keys.shape[1], dim, query.stride(1), query.stride(2), keys.stride(1),
        values.stride(1), dim ** -0.5 if scale is None else scale, torch.get_num_threads())
    if status != 0:
        raise MemoryError("the CPU prefill attention kernel could not allocate its work buffers")
    return out


def _check_float32(*tensors: torch.Tensor) -> None:
    if any(t.dtype != torch.float32 or not t.is_cpu for t in tensors):  # is_cpu: no device object made
        raise TypeError("the CPU kernels take float32 tensors on the CPU")
