"""The CPU decode step without HF's per-op overhead: Llama-family layers run straight on the CPU kernels.

Through the HF decoder layers (blend.batch.DecodeStepper), a SmolLM2 step of one row spends ~18 of its ~50 ms
outside its linears and attention: ~1,750 small torch ops and the modules' Python, 30 layers of it. This
step runs the same layers as a short loop: per layer the model's two norm modules, three linears for q/k/v,
`rope_write` (RoPE on the new queries and keys and the pool write, one C call), `decode_attention`, the
output projection, the MLP's three linears and its activation module, two residual adds.

Every float operation is the one the HF layers do (the same kernels, RoPE as the same products and sums),
so the logits are the same bits: `KernelStep.verify` checks that on a probe before the step is used, and
`KernelStep.refusal` names what keeps a model off it (layers that are not Llama's shape: Qwen3's q/k norms,
Gemma's extra norms; weights the kernels do not take). Those decode through the HF layers as before.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from blend import cpu_kernels
from blend.pool import KVPool
from blend.skinny import SkinnyLinear

LAYER_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
ATTENTION_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj"}
MLP_PARTS = {"gate_proj", "up_proj", "down_proj", "act_fn"}
PROBE_ROWS, PROBE_STEPS, PROBE_LENGTH = 2, 3, 16   # verify's probe: rows, steps, and its pools' length


def _project(x: torch.Tensor, *modules: SkinnyLinear) -> list[torch.Tensor]:
    """x [rows, in] through each module → [rows, out] each: one kernel call, biases added as SkinnyLinear does."""
    outs = cpu_kernels.linear_rows_many(x, [m.weight for m in modules])
    return [out if m.bias is None else out + m.bias for out, m in zip(outs, modules)]


class KernelStep:
    def __init__(self, model: nn.Module, pool: KVPool, num_layers: int):
        self.model, self.decoder, self.pool = model, model.model, pool
        self.layers = list(self.decoder.layers[:num_layers])

    @staticmethod
    def refusal(model: nn.Module) -> str | None:
        """Why `model`'s decoder layers cannot run as a KernelStep (None: they can, if `verify` agrees)."""
        for layer in model.model.layers:
            parts = {name for name, _ in layer.named_children()}
            attention = {name for name, _ in getattr(layer, "self_attn", nn.Module()).named_children()}
            mlp = {name for name, _ in getattr(layer, "mlp", nn.Module()).named_children()}
            if (parts, attention, mlp) != (LAYER_PARTS, ATTENTION_PARTS, MLP_PARTS):
                return (f"{type(layer).__name__} is not a Llama-shaped layer (parts {sorted(parts)}, attention "
                        f"{sorted(attention)}, MLP {sorted(mlp)})")
            linears = [getattr(layer.self_attn, n) for n in sorted(ATTENTION_PARTS)]
            linears += [getattr(layer.mlp, n) for n in sorted(MLP_PARTS - {"act_fn"})]
            if not all(isinstance(linear, SkinnyLinear) and linear.kernel for linear in linears):
                return "a projection does not run on the CPU kernel (not float32, or not contiguous)"
        return None

    @staticmethod
    @torch.inference_mode()
    def verify(model: nn.Module, pool: KVPool, num_layers: int,
               reference: Callable[[KVPool], Callable[..., torch.Tensor]]) -> str | None:
        """None if a KernelStep gives the same bits as `reference(pool)` (the HF layers' step): both run
        PROBE_STEPS greedy steps of PROBE_ROWS rows at different lengths, each over its own small pool shaped
        like `pool`; else what differs."""
        layers, _, heads, _, dim = pool.keys.shape
        pools = [KVPool(layers, heads, dim, slots=PROBE_ROWS, max_len=PROBE_LENGTH, dtype=pool.keys.dtype,
                        device=pool.keys.device) for _ in range(2)]
        for probe in pools:
            probe.readable(PROBE_ROWS, probe.columns)                                  # zeros: finite
        steps = [reference(pools[0]), KernelStep(model, pools[1], num_layers).logits]
        vocab = model.get_output_embeddings().weight.shape[0]
        tokens = torch.arange(1, PROBE_ROWS + 1, device=pool.keys.device) * 7 % vocab      # [rows]
        positions = torch.arange(PROBE_ROWS, device=pool.keys.device) * 3                  # [rows]
        for _ in range(PROBE_STEPS):
            try:
                want, got = (step(tokens, positions, pools[0].columns) for step in steps)
            except Exception as exc:  # noqa: BLE001 - e.g. a model gated off the pooled step: its own attention
                return f"the probe did not run: {type(exc).__name__}: {exc}"
            if not (torch.equal(want, got) and torch.equal(pools[0].keys, pools[1].keys)
                    and torch.equal(pools[0].values, pools[1].values)):
                return (f"the kernel step's logits differ from the HF layers' by up to "
                        f"{float((want - got).abs().max()):.3g} on a probe (they must be the same bits)")
            tokens, positions = want.argmax(-1), positions + 1
        return None

    def logits(self, tokens: torch.Tensor, positions: torch.Tensor, key_columns: int) -> torch.Tensor:
        """tokens, positions [rows] (int64) → next-token logits [rows, V], as DecodeStepper.logits."""
        rows, pool = tokens.shape[0], self.pool
        hidden = self.decoder.embed_tokens(tokens)                                     # [rows, hidden]
        cos, sin = self.decoder.rotary_emb(hidden[:, None], position_ids=positions[:, None])   # [rows, 1, D]
        cos, sin = cos[:, 0], sin[:, 0]                                                # [rows, D]
        lengths = torch.where(positions == pool.scratch, 0, positions + 1)            # [rows]; 0: padding
        for index, layer in enumerate(self.layers):
            attention, mlp = layer.self_attn, layer.mlp
            x = layer.input_layernorm(hidden)
            keys, values = pool.keys[index], pool.values[index]                        # [slots, Hkv, columns, D]
            query = cpu_kernels.rope_write(*_project(x, attention.q_proj, attention.k_proj, attention.v_proj),
                                           cos, sin, positions, keys, values)                # [rows, Hq, D]
            grouped = query.view(rows, keys.shape[1], -1, keys.shape[3])               # [rows, Hkv, G, D]
            out = cpu_kernels.decode_attention(grouped, keys[:rows, :, :key_columns], values[:rows, :, :key_columns],
                                               lengths, attention.scaling)
            hidden = hidden + _project(out.view(rows, -1), attention.o_proj)[0]
            gate, up = _project(layer.post_attention_layernorm(hidden), mlp.gate_proj, mlp.up_proj)
            hidden = hidden + _project(mlp.act_fn(gate) * up, mlp.down_proj)[0]
        return self.model.lm_head(self.decoder.norm(hidden))                          # [rows, V]
