"""Attention and few-row linears on the CPU as torch custom ops (kernels/cpu_kernels.cpp, `torch.ops.ragblend.*`),
built once per machine by torch.utils.cpp_extension.

A decode step streams every weight and each row's K/V from memory for little arithmetic, and torch's CPU
kernels do that at a fraction of the machine's bandwidth (2 cores, ~25 GB/s here):

- `decode_attention`: sdpa runs a step's few queries per KV head (the query heads sharing it) as tiny GEMMs
  over 512-key blocks: one SmolLM2 layer, 4 rows of 2.5k keys, 1.6 ms against 0.6 ms to read its K/V once.
  The kernel reads each row's keys once, up to its own length, prefetching the next task's while it works on
  its own from cache: all 30 layers, 4 rows 50 → 28 ms, 1 row 16 → 8 ms (at 3.2k keys, 31 → 27 ms for 4 rows
  with the prefetch). Each key and value vector is widened to floats in registers and used there by up to three
  query heads of its group at once (float16 pool: 30 layers at 3.1k keys, 1 row 7.7-9.1 → 3.2-5.1 ms, 4 rows
  22.6 → 12-15 ms).
- `linear_rows`: MKL runs one row as a GEMV on one thread, and 2–16 rows, even as (W @ xᵀ)ᵀ (blend.skinny),
  at ~14 GB/s. The kernel streams the weights once over both threads: all linears + the LM head, 1 row
  38 → 24 ms, 4 rows 40 → 28 ms, 8 rows 56 → 34 ms.
  `linear_rows_many` runs a layer's projections of one input in one call, its threads each taking an equal run
  of the outputs as if the weights were one matrix: 30 layers' q/k/v 4.8 → 3.5-4 ms. `quantized_rows` is the
  same over 8- or 4-bit codes (GGUF's blocks): the codes are widened to floats, 4-bit ones split into nibbles in
  32-bit lanes (30 layers' linears at one row, int4, 8.2-10.1 → 5.8-7.6 ms).
- `rope_write`: RoPE on a step's new queries and keys in HF's rotate-half form (the same bits) and the keys
  and values written into the pool.
- `int8_round_trip`: the int8 codec's pack and unpack of a prefill's spans to be stored, in place, in one pass
  (torch's ops took ~10: 30 layers at 3.1k rows and 200 spans 146 → 26 ms, ~1.5% of a cold prompt's prefill).
- `decode_layer`: a whole Llama-shaped layer of a decode step, the kernels above in turn with the norms, SiLU
  and residual adds as plain loops: one call a layer in place of ~60 small torch ops (blend.kernel_step).

Each row's result depends on its own inputs only, never on the step's other rows (nor on the masked columns
after a row's length), so a request decodes the same tokens alone or batched.

A blended prefill's attention is compute-bound instead: a few hundred queries at scattered positions over the
whole prompt. torch's CPU flash kernel (blend.attention's planned pieces) runs it at ~67 GFLOP/s here;
`prefill_attention` is flash attention over each query's own keys [0, position] with register-tiled
products (fused multiply-adds: a prefill runs alone): one SmolLM2 layer, 405 queries over 3.1k keys,
27.9 → 16.6 ms (107 useful GFLOP/s).

How they are built, and why so:
- Custom ops (TORCH_LIBRARY in the C++ file, its schemas and CPU kernels there; the fake, shape-only forms
  here, registered when the library loads): the dispatcher calls them with no Python in between (a decode step
  makes ~120 calls), the profiler names them, FakeTensor and torch.compile trace them, and every op checks what
  it will read and write itself (shapes, strides, dtypes, lengths, positions), however it is reached.
- Threads from ATen's intra-op pool (`at::parallel_for`, as many as torch.get_num_threads()): torch's OpenMP
  build implements it as OpenMP pragmas compiled into the caller (ATen/ParallelOpenMP.h; without `-fopenmp` it
  runs on one thread), so the source is built with `-fopenmp` but linked without an OpenMP library of its own:
  its OpenMP calls resolve to the runtime torch loaded (libtorch_cpu's), one thread pool in the process.
- `-O3 -march=native -ffp-contract=off`: this machine's vectors; no fused multiply-adds outside the prefill
  kernel, so a decode row's sums are the same bits at any row count (see the C++ file).
- torch.utils.cpp_extension.load (with ninja and the C++ compiler, $CXX or c++) builds into a fresh temporary
  directory under the cache ($RAGBLEND_KERNEL_DIR, else ~/.cache/ragblend/kernels), and the library is moved
  into place by an atomic rename, named by a hash of the source, the compiler, the CPU and torch's version:
  processes that build at once each finish on their own (cpp_extension's lock file in a shared build directory
  would make the others wait forever on a builder that was killed), a failed build leaves nothing behind, and
  the next process loads the library without building.
Without a compiler or ninja, or when the build fails, `load()` returns None with the reason in `unavailable()`
(logged once), and decode steps and prefills use torch's sdpa and MKL instead.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import logging.handlers
import os
import platform
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Iterator, Sequence

import torch

log = logging.getLogger("ragblend.blend")

SOURCE = Path(__file__).with_name("kernels") / "cpu_kernels.cpp"
LINEAR_ROWS = 8  # linear_rows takes 1..this many rows (LINEAR_ROWS in the C++ file)
QGROUP = 32  # quantized_rows' weights: a scale (and a min) per this many inputs of a row (QGROUP likewise)
PREFILL_DIM_MULTIPLE = 16  # prefill_attention's head sizes: its tiles are two vectors of 8 floats wide (likewise)
FLAGS = ("-O3", "-march=native", "-ffp-contract=off")

_lock = threading.Lock()
_library: Path | None = None
_reason: str | None = None  # why there is no library (None: built, or not tried yet)


def cache_dir() -> Path:
    """Where built kernels live: $RAGBLEND_KERNEL_DIR, else the user's cache (~/.cache/ragblend/kernels)."""
    if configured := os.environ.get("RAGBLEND_KERNEL_DIR"):
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ragblend" / "kernels"


def _compile_flags() -> list[str]:
    # at::parallel_for is OpenMP compiled into this library where torch's intra-op pool is OpenMP's
    return [*FLAGS, *(["-fopenmp"] if torch.backends.openmp.is_available() else [])]


def _build_identity(compiler: str) -> str:
    """What the built library depends on besides its source: the compiler, this CPU (-march=native), the flags,
    and torch (the library links its C++ API)."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30, check=True)
    cpu = ""
    if Path("/proc/cpuinfo").exists():
        cpu = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    return "\n".join([version.stdout, platform.machine(), cpu, " ".join(_compile_flags()), torch.__version__,
                      str(torch.version.git_version)])


@contextlib.contextmanager
def _torch_build_messages() -> Iterator[logging.handlers.BufferingHandler]:
    """cpp_extension's log records (e.g. its warning about an unfamiliar compiler) held back while it builds:
    the build prints nothing of its own; a failure is reported once, with its reason."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    held, propagate = logging.handlers.BufferingHandler(capacity=1000), logger.propagate
    logger.addHandler(held)
    logger.propagate = False
    try:
        yield held
    finally:
        logger.removeHandler(held)
        logger.propagate = propagate


def _build() -> Path:
    compiler = os.environ.get("CXX", "c++")  # the one torch.utils.cpp_extension builds with
    digest = hashlib.sha256(SOURCE.read_bytes() + _build_identity(compiler).encode()).hexdigest()[:16]
    target = cache_dir() / f"cpu_kernels-{digest}.so"
    if target.exists():
        torch.ops.load_library(str(target))
        return target
    from torch.utils import cpp_extension  # imports setuptools (~1 s): only to build

    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as building, _torch_build_messages() as messages:
        try:  # builds into `building` and loads the library from there
            cpp_extension.load("ragblend_kernels", [str(SOURCE)], extra_cflags=_compile_flags(),
                               build_directory=building, is_python_module=False)
        finally:
            for record in messages.buffer:
                log.debug("cpp_extension: %s", record.getMessage())
        os.replace(Path(building) / "ragblend_kernels.so", target)
    log.info("built the CPU kernels", extra={"path": str(target)})
    return target


def load() -> Path | None:
    """The ops' library (torch.ops.ragblend.*), built and loaded at the first call; None (reason logged once) if
    it cannot be."""
    global _library, _reason
    with _lock:
        if _library is None and _reason is None:
            try:
                _library = _build()
                _register_fakes()
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                message = str(exc)  # a failed build's: its command lines, then the compiler's errors
                if len(message) > 1200:
                    message = f"{message[:200]} ... {message[-1000:]}"
                _reason = f"{type(exc).__name__}: {message}"
                log.warning("no CPU kernels; decode steps and prefills use torch's sdpa and MKL",
                            extra={"reason": _reason})
        return _library


def loaded() -> bool:
    """Whether this process has the ops (a backend's `load()` gave them), for a caller that must not build them
    (blend.cpu_kernel: off leaves them unbuilt)."""
    return _library is not None


def unavailable() -> str | None:
    """Why `load()` gave no kernels (None: it gave them, or was not called yet)."""
    return _reason


def _register_fakes() -> None:
    """The ops' output shapes for FakeTensor and torch.compile's tracing (registered once the ops exist)."""
    @torch.library.register_fake("ragblend::decode_attention")
    def _(query, keys, values, lengths, scale=None):
        return query.new_empty(query.shape)                                       # [rows, Hkv, G, D]

    @torch.library.register_fake("ragblend::linear_rows")
    def _(x, weight):
        return x.new_empty(x.shape[0], weight.shape[0])                          # [rows, out]

    @torch.library.register_fake("ragblend::linear_rows_many")
    def _(x, weights):
        return x.new_empty(x.shape[0], sum(w.shape[0] for w in weights))         # [rows, Σ out]

    @torch.library.register_fake("ragblend::quantized_rows")
    def _(x, codes, scales, mins):
        return x.new_empty(x.shape[0], sum(c.shape[0] for c in codes))          # [rows, Σ out]

    @torch.library.register_fake("ragblend::rope_write")
    def _(query, key, value, cos, sin, positions, pool_keys, pool_values):
        rows, dim = cos.shape
        return query.new_empty(rows, query.shape[1] // dim, dim)                # [rows, Hq, D]

    @torch.library.register_fake("ragblend::decode_layer")
    def _(hidden, *args):
        return hidden.new_empty(hidden.shape)                                    # [rows, H]

    @torch.library.register_fake("ragblend::prefill_attention")
    def _(query, keys, values, positions, scale=None):
        _, heads, count, dim = query.shape
        return query.new_empty(1, count, heads, dim)                             # [1, Tq, Hq, D]

    @torch.library.register_fake("ragblend::int8_round_trip")
    def _(keys, values, spans):
        return None


def decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """query [rows, Hkv, G, D] (the G query heads of each KV head) over keys/values [rows, Hkv, T, D] (views of
    the pool, each key's D floats contiguous) up to lengths [rows] (0 for a padding row, whose output is zeros);
    returns [rows, Hkv, G, D]. float32 on the CPU; `load()` must have given a library."""
    return torch.ops.ragblend.decode_attention(query, keys, values, lengths, scale)


def linear_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [rows, in] (1..LINEAR_ROWS rows) @ weight [out, in]ᵀ → [rows, out], float32 on the CPU, the weight
    contiguous."""
    return torch.ops.ragblend.linear_rows(x, weight)


def linear_rows_many(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """x [rows, in] (1..LINEAR_ROWS rows) @ [w₀; w₁; ..]ᵀ → [rows, Σ out]: the weights [out_m, in] wherever each
    lies in memory (nothing is copied), their outputs side by side, each as linear_rows gives it, in one call
    that streams them as if they were one matrix (a layer's q/k/v, or gate/up)."""
    return torch.ops.ragblend.linear_rows_many(x, weights)


def quantized_rows(x: torch.Tensor, codes: Sequence[torch.Tensor], scales: Sequence[torch.Tensor],
                   mins: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """linear_rows_many on quantised weights (blend.quantized's forms, groups of QGROUP inputs): 8-bit codes int8
    [out, in] (w = scale·q), or 4-bit codes uint8 [out, in/2] with `mins` (w = scale·q + min); scales and mins
    float32 [out, in/QGROUP]. x [rows, in] (1..LINEAR_ROWS rows, in a multiple of QGROUP) → [rows, Σ out]."""
    return torch.ops.ragblend.quantized_rows(x, list(codes), list(scales), list(mins))


def rope_write(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               positions: torch.Tensor, pool_keys: torch.Tensor, pool_values: torch.Tensor) -> torch.Tensor:
    """A decode step's new tokens, query [rows, Hq·D], key and value [rows, Hkv·D] (rows of D-float heads; row
    strides free): RoPE on the queries and keys (HF's rotate-half form, the same bits), the rotated keys and the
    values written into one pool layer, pool_keys/pool_values [slots, Hkv, columns, D], row r at slot r and
    column positions[r] [rows]. cos, sin [rows, D]. Returns the rotated queries [rows, Hq, D]."""
    return torch.ops.ragblend.rope_write(query, key, value, cos, sin, positions, pool_keys, pool_values)


def decode_layer(hidden: torch.Tensor, input_norm: torch.Tensor, post_norm: torch.Tensor, eps: float,
                 qkv: list[torch.Tensor], output: list[torch.Tensor], gate_up: list[torch.Tensor],
                 down: list[torch.Tensor], biases: list[torch.Tensor | None], q_size: int, kv_size: int,
                 cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor,
                 pool_keys: torch.Tensor, pool_values: torch.Tensor, key_columns: int, scale: float) -> torch.Tensor:
    """One Llama-shaped decoder layer of a decode step: hidden [rows, H] → [rows, H]. RMSNorm (input_norm [H],
    eps), q/k/v (one product over `qkv`: float32 weights [w_q, w_k, w_v], or quantised (codes, scales[, mins]) per
    matrix; q's width q_size, k's and v's kv_size), rope_write into pool_keys/pool_values [slots, Hkv, columns, D]
    at `positions` (cos, sin [rows, D]), decode_attention over each row's first lengths[r] keys of the first
    key_columns, the output projection, RMSNorm (post_norm), gate/up (gate's columns first), SiLU(gate)·up, down,
    and the two residual adds; biases: q/k/v's, o's, gate/up's and down's ([Σ out] or None)."""
    return torch.ops.ragblend.decode_layer(hidden, input_norm, post_norm, eps, qkv, output, gate_up, down, biases,
                                           q_size, kv_size, cos, sin, positions, lengths, pool_keys, pool_values,
                                           key_columns, scale)


def prefill_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                      scale: float | None = None) -> torch.Tensor:
    """Causal attention of one prompt's queries at sorted absolute `positions` [Tq] over its keys at positions
    0..: query [1, Hq, Tq, D], keys/values [1, Hkv, Tk, D] (Tk > positions[-1]; each key's D floats contiguous;
    keys after the last position are never read) → [1, Tq, Hq, D]. float32 on the CPU, D a multiple of
    PREFILL_DIM_MULTIPLE; `load()` must have given a library."""
    return torch.ops.ragblend.prefill_attention(query, keys, values, positions, scale)


def int8_round_trip(keys: torch.Tensor, values: torch.Tensor, spans: torch.Tensor) -> None:
    """The int8 codec's pack and unpack of each span, in place and bit for bit (store.codecs.Int8Codec: keys
    scaled per span and channel, values per row): keys/values [1, H, N, D] (rows of D floats), spans [S, 2] int64
    (start, end). One pass a layer where torch's ops take ~10 (a prefill rounds every span it will store, at every
    layer). float32 on the CPU; `load()` must have given a library."""
    torch.ops.ragblend.int8_round_trip(keys, values, spans)
