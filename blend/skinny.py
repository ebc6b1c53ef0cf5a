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

`use_skinny_linears(model)` switches the model's plain `nn.Linear` modules to `SkinnyLinear`
(the same parameters; only `forward` differs, and only for 1..SKINNY_ROWS rows on the CPU).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

SKINNY_ROWS = 16  # up to this many rows (tokens in the batch) take the (W @ xᵀ)ᵀ path
PADDED_ROWS = {1: 2, 3: 4}  # row counts run with zero rows added, as a count MKL threads better


class SkinnyLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if not 1 <= rows <= SKINNY_ROWS or x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, self.in_features)                     # [rows, in]
        if rows in PADDED_ROWS:
            flat = torch.cat([flat, flat.new_zeros(PADDED_ROWS[rows] - rows, self.in_features)])
        out = (self.weight @ flat.t()).t()[:rows]                    # [rows, out]
        if self.bias is not None:
            out = out + self.bias
        return out.contiguous().view(*x.shape[:-1], self.out_features)


def use_skinny_linears(model: nn.Module) -> int:
    """Switch `model`'s plain nn.Linear modules to SkinnyLinear in place; returns how many."""
    switched = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = SkinnyLinear  # same module, same weights: only forward changes
            switched += 1
    return switched
