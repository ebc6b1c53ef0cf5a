"""Faster linear layers for a few rows on the CPU (the decode steps of a batch).

A decode step multiplies B ≤ max_batch rows by every weight matrix, so it streams all the weights
from memory for very little arithmetic. On the CPU, MKL does that badly through `F.linear`
(x @ Wᵀ) once there are 2 or more rows: it costs about twice one row. The same product computed
the other way round, (W @ xᵀ)ᵀ, streams W once for 2–16 rows. Measured on this project's 2-core
machine, all 30 SmolLM2 layers' linears plus the LM head (quiet, 2 threads): 2 rows 57 ms vs
123 ms, 4 rows 55 vs 124, 8 rows 95 vs 109, 16 rows 116 vs 141.

One row is a GEMV, which MKL runs on one thread here (50 ms, 1 thread or 2); one zero row more makes it
a GEMM it spreads over both (38.5 ms). Three rows likewise run as four (45 → 40 ms). Other counts gain
nothing from padding (PADDED_ROWS).

Where the CPU decode kernels are built (blend.cpu_kernels), 1..8 rows of a float32 layer go through
`linear_rows` instead, which streams the weights over both threads at near the memory's speed (all 30 layers +
the LM head: 1 row 24 ms, 4 rows 28 ms, 8 rows 34 ms); a row's result is then the same whatever the rows with
it, as in the attention kernel.

Many rows (a prefill's) go through `F.linear` (MKL's sgemm, ~100 GFLOP/s on SmolLM2's widening layers here).
oneDNN's matmul runs them at ~130, but torch reaches it only through a private op (`mkldnn._linear_pointwise`)
or through oneDNN's own tensor layout (`aten.mkldnn_linear`, whose copies in and out cost what it gains), so
a prefill's linears stay on the public path: one SmolLM2 layer's linears at 3.1k rows take ~1.25x oneDNN's
time (bench/kernels.py, `prefill_linears`), and a blended prefill of 3.1k tokens took 1.87–1.92 s through MKL
against 1.74–1.77 s through oneDNN (BENCHMARKS.md, 6a17731).

`use_skinny_linears(model, kernel)` switches the model's plain `nn.Linear` modules to `SkinnyLinear`
(the same parameters; only `forward` differs). Only the CPU backend switches them (blend.backend), so a
SkinnyLinear's input is always on the host.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from blend import cpu_kernels

SKINNY_ROWS = 16  # up to this many rows (tokens in the batch) take the (W @ xᵀ)ᵀ path
PADDED_ROWS = {1: 2, 3: 4}  # row counts run with zero rows added, as a count MKL threads better


class SkinnyLinear(nn.Linear):
    kernel = False  # 1..LINEAR_ROWS float32 rows through cpu_kernels.linear_rows (set by use_skinny_linears)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if not 1 <= rows <= SKINNY_ROWS:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, self.in_features)                     # [rows, in]
        if self.kernel and rows <= cpu_kernels.LINEAR_ROWS and x.dtype == torch.float32:
            out = cpu_kernels.linear_rows(flat, self.weight)         # [rows, out]
        else:
            if rows in PADDED_ROWS:
                flat = torch.cat([flat, flat.new_zeros(PADDED_ROWS[rows] - rows, self.in_features)])
            out = (self.weight @ flat.t()).t()[:rows]                # [rows, out]
        if self.bias is not None:
            out = out + self.bias
        return out.contiguous().view(*x.shape[:-1], self.out_features)


def use_skinny_linears(model: nn.Module, kernel: bool = False) -> int:
    """Switch `model`'s plain nn.Linear modules to SkinnyLinear in place, through the CPU kernel (`kernel`: the
    caller has built it) where a float32 weight is contiguous; returns how many."""
    switched = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = SkinnyLinear  # same module, same weights: only forward changes
            switched += 1
        if isinstance(module, SkinnyLinear):
            module.kernel = kernel and module.weight.dtype == torch.float32 and module.weight.is_contiguous()
    return switched
