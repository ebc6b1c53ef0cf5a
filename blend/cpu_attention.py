"""The decode step's attention on the CPU as a small C kernel (kernels/decode_attention.c), built once per
machine with the system's C compiler and called through ctypes.

torch's CPU sdpa runs a decode step's few queries per KV head (the query heads that share it) as tiny
GEMMs over 512-key blocks, at about a third of the memory bandwidth (one layer of SmolLM2, 4 rows of 2.5k
keys: 1.6 ms, against 0.6 ms to read its K/V once). The kernel reads each row's keys up to its own length
once, and adds four dot products at a time across their vector lanes: all 30 layers of a 4-row step
48 → 28 ms, of a 1-row step 16 → 8.5 ms (BENCHMARKS.md, round 7). Each row's result depends on its own
keys only, never on the other rows of the step or on the masked columns after its length.

The library is compiled with `-march=native` (this machine's vectors) into a per-user cache, named by a
hash of the source, the compiler and the CPU, written by atomic rename (processes may build it at once).
Without a compiler, or when the build fails, `load()` returns None with the reason in `unavailable()`,
and the decode step uses torch's sdpa instead.
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

import torch

log = logging.getLogger("ragblend.blend")

SOURCE = Path(__file__).with_name("kernels") / "decode_attention.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")

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
    target = cache_dir() / f"decode_attention-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            done = subprocess.run([compiler, *FLAGS, "-o", str(built), str(SOURCE), "-lm"], capture_output=True,
                                  text=True, timeout=120)
            if done.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
            os.replace(built, target)
        log.info("built the CPU decode attention kernel", extra={"path": str(target)})
    library = ctypes.CDLL(str(target))
    function = library.decode_attention
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 8 + [ctypes.c_float, ctypes.c_int]
    return library


def load() -> ctypes.CDLL | None:
    """The built kernel library, building it at the first call; None (reason logged once) if it cannot be."""
    global _library, _reason
    with _lock:
        if _library is None and _reason is None:
            try:
                _library = _build()
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                _reason = f"{type(exc).__name__}: {exc}"
                log.warning("no CPU decode attention kernel; the decode step uses torch's sdpa",
                            extra={"reason": _reason})
        return _library


def unavailable() -> str | None:
    """Why `load()` gave no kernel (None: it gave one, or was not called yet)."""
    return _reason


def decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """query [rows, Hkv, G, D] (the G query heads of each KV head) over keys/values [rows, Hkv, T, D] (views of
    the pool: rows `D` apart) up to lengths [rows] (int64; 0 for a padding row, whose output is zeros);
    returns [rows, Hkv, G, D]. float32 on the CPU; `load()` must have given a library."""
    rows, heads, group, dim = query.shape
    if query.dtype != torch.float32 or keys.dtype != torch.float32 or values.dtype != torch.float32:
        raise TypeError("the CPU decode attention kernel takes float32 tensors")
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
