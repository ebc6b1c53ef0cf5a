"""Linear layers on quantised weights for the CPU's decode steps (model.weights: int8 | int4).

A decode step streams every weight from memory for a few rows of arithmetic: float32 SmolLM2 reads ~540 MB a
step. Kept as codes in groups of QGROUP inputs along each row, GGUF's own block forms, a step reads a quarter
(int8: w = scale·q, q a signed byte, Q8_0's form) or about a sixth (int4: w = scale·q + min, q 0..15, Q4_1's
form) of that through `cpu_kernels.quantized_rows`. With int4 the LM head (tied to the embeddings in SmolLM2)
stays 8-bit, as llama.cpp's Q4 files keep it.

The model's weights become the quantised ones: each linear's float32 weight is overwritten with its codes
dequantised, so every path computes with the same weights. A prefill's many rows keep MKL's float32 GEMM on
that copy (torch's own quantised CPU matmuls, `_weight_int8pack_mm` and `_weight_int4pack_mm_for_cpu`, took
50-100x sgemm's time at 512 rows of SmolLM2's shapes here, and 5-10x `linear_rows`' at one row); 1..LINEAR_ROWS
rows (a decode step's) read the codes. The embedded model's weights come from a GGUF of Q4_1 layers and a Q8_0
embedding, so int4 gives back its float32 weights to within float rounding: its answers are float32's.
"""
from __future__ import annotations

import torch
from torch import nn

from blend import cpu_kernels
from blend.skinny import SkinnyLinear

WEIGHTS = ("float32", "int8", "int4")
QGROUP = cpu_kernels.QGROUP


class QuantizedLinear(SkinnyLinear):
    """A SkinnyLinear whose weight is its codes dequantised; 1..LINEAR_ROWS float32 rows run on the codes."""
    bits: int
    codes: torch.Tensor    # int8 [out, in] (8 bits) or uint8 [out, in/2] (4 bits: group byte j = elements j, j+16)
    scales: torch.Tensor   # float32 [out, in/QGROUP]
    mins: torch.Tensor     # float32 [out, in/QGROUP] (4 bits), else [0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if not (self.kernel and 1 <= rows <= cpu_kernels.LINEAR_ROWS and x.dtype == torch.float32):
            return super().forward(x)
        out = quantized_product([self])(x.reshape(rows, self.in_features))           # [rows, out]
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


def quantized_product(linears: list[QuantizedLinear]):
    """x [rows, in] → [rows, Σ out]: the linears' products side by side in one kernel call (all of one width)."""
    codes, scales = [linear.codes for linear in linears], [linear.scales for linear in linears]
    mins = [linear.mins for linear in linears] if linears[0].bits == 4 else []
    return lambda x: cpu_kernels.quantized_rows(x, codes, scales, mins)


def quantize(weight: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [out, in] (in a multiple of QGROUP) → (codes, scales, mins) in QuantizedLinear's layout: 8 bits
    symmetric (scale = max |w| / 127 per group), 4 bits from each group's min to its max in 15 steps."""
    out, features = weight.shape
    groups = weight.detach().float().reshape(out, features // QGROUP, QGROUP)            # [out, G, QGROUP]
    if bits == 8:
        scales = (groups.abs().amax(-1) / 127).clamp(min=torch.finfo(torch.float32).tiny)   # [out, G]
        codes = torch.round(groups / scales[..., None]).clamp(-127, 127).to(torch.int8).reshape(out, features)
        return codes.contiguous(), scales.contiguous(), scales.new_zeros(0)
    low, high = groups.amin(-1), groups.amax(-1)                                            # [out, G]
    scales = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8)  # [out, G, QGROUP]
    codes = (q[..., :QGROUP // 2] | (q[..., QGROUP // 2:] << 4)).reshape(out, features // 2)
    return codes.contiguous(), scales.contiguous(), low.contiguous()


def dequantize(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The weights [out, in] that quantize's (codes, scales, mins) stand for, float32."""
    out, groups = scales.shape
    if codes.dtype == torch.int8:
        return (codes.reshape(out, groups, QGROUP).float() * scales[..., None]).reshape(out, -1)
    packed = codes.reshape(out, groups, QGROUP // 2)
    q = torch.cat([packed & 15, packed >> 4], dim=-1).float()                              # [out, G, QGROUP]
    return (q * scales[..., None] + mins[..., None]).reshape(out, -1)


def quantize_linears(model: nn.Module, weights: str) -> int:
    """Switch `model`'s float32 nn.Linear modules whose inputs come in whole groups to QuantizedLinear in place
    (int8: 8 bits; int4: 4 bits, the LM head 8), their weights overwritten with the codes dequantised (tied
    embeddings too: they are the same tensor); returns how many. float32: nothing changes."""
    if weights not in WEIGHTS:
        raise ValueError(f"model.weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    if weights == "float32":
        return 0
    head = model.get_output_embeddings()
    switched = 0
    for module in model.modules():
        if not (isinstance(module, nn.Linear) and module.weight.dtype == torch.float32
                and module.in_features % QGROUP == 0):
            continue
        bits = 8 if weights == "int8" or module is head else 4
        with torch.no_grad():
            codes, scales, mins = quantize(module.weight, bits)
            module.weight.copy_(dequantize(codes, scales, mins))
        module.__class__ = QuantizedLinear
        module.bits = bits
        for name, tensor in (("codes", codes), ("scales", scales), ("mins", mins)):
            module.register_buffer(name, tensor, persistent=False)  # the state dict keeps the float weights
        switched += 1
    return switched
