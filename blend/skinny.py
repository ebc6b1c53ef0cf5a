"""Faster linear layers for a few rows on the CPU (the decode steps).

A decode step multiplies B ≤ max_batch rows by every weight matrix, so it streams ~all the weights
from memory for very little arithmetic. On the CPU, MKL does that badly through `F.linear`
(x @ Wᵀ): for 2–8 rows it is 1.5–3.5× slower than 1 row, and 1 row runs as a single-threaded
GEMV. The same product computed the other way round, (W @ xᵀ)ᵀ, streams W once with every core
for 2–16 rows (measured on this project's 2-core machine: 8 rows through 200 [1536, 576] weights
141 ms vs 225 ms; the [49152, 576] LM head at 4 rows 11 ms vs 44 ms). A single row is doubled to
take that path too.

`use_skinny_linears(model)` switches the model's plain `nn.Linear` modules to `SkinnyLinear`
(the same parameters; only `forward` differs, and only for ≤ SKINNY_ROWS rows on the CPU).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

SKINNY_ROWS = 16  # up to this many rows (tokens in the batch) take the (W @ xᵀ)ᵀ path


class SkinnyLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows > SKINNY_ROWS or x.device.type != "cpu" or rows == 0:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, self.in_features)                     # [rows, in]
        if rows == 1 and torch.get_num_threads() > 1:
            flat = flat.repeat(2, 1)                                 # a GEMM on every core, not a one-thread GEMV
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
