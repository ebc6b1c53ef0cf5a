"""The CPU decode step without HF's per-op overhead: Llama-family layers run straight on the CPU kernels.

Through the HF decoder layers (blend.batch.DecodeStepper), a SmolLM2 step of one row spends ~18 of its ~50 ms
outside its linears and attention: ~1,750 small torch ops and the modules' Python, 30 layers of it. This
step runs the same layers as a short loop: per layer the model's two norm modules, the q/k/v projections,
`rope_write` (RoPE on the new queries and keys and the pool write, one C call), `decode_attention`, the
output projection, gate/up, the activation module, down, two residual adds; a layer's projections of one
input run as one kernel call (`Projections`).

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


class Projections:
    """Linears of one input as one kernel call (cpu_kernels.linear_rows_many): the weights stay where they are
    (the model keeps its memory: its file's pages, when loaded mapped), streamed as if they were one matrix.
    Biases are added as SkinnyLinear adds them."""

    def __init__(self, *linears: SkinnyLinear):
        self.weights, self.sizes = [linear.weight for linear in linears], [linear.out_features for linear in linears]
        has_bias = linears[0].bias is not None  # all or none (KernelStep.refusal)
        self.bias = torch.cat([linear.bias for linear in linears]) if has_bias else None   # [Σ out]: a few floats

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x [rows, in] → each linear's [rows, out] (column blocks of one output)."""
        out = cpu_kernels.linear_rows_many(x, self.weights)                            # [rows, Σ out]
        return list((out if self.bias is None else out + self.bias).split(self.sizes, dim=1))


class KernelStep:
    """A decode step's forward for Llama-shaped layers on the CPU kernels, over any pool shaped for the model
    (DecodeStepper.logits hands it its pool)."""

    def __init__(self, model: nn.Module, num_layers: int):
        self.model, self.decoder = model, model.model
        self.layers = list(self.decoder.layers[:num_layers])
        self.qkv = [Projections(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)
                    for layer in self.layers]
        self.output = [Projections(layer.self_attn.o_proj) for layer in self.layers]
        self.gate_up = [Projections(layer.mlp.gate_proj, layer.mlp.up_proj) for layer in self.layers]
        self.down = [Projections(layer.mlp.down_proj) for layer in self.layers]

    @staticmethod
    def refusal(model: nn.Module) -> str | None:
        """Why `model`'s decoder layers cannot run as a KernelStep (None: they can, if `verify` agrees)."""
        for layer in model.model.layers:
            modules = (layer, getattr(layer, "self_attn", nn.Module()), getattr(layer, "mlp", nn.Module()))
            parts = [{name for name, _ in module.named_children()} for module in modules]
            if parts != [LAYER_PARTS, ATTENTION_PARTS, MLP_PARTS]:
                return (f"{type(layer).__name__} is not a Llama-shaped layer (parts {sorted(parts[0])}, attention "
                        f"{sorted(parts[1])}, MLP {sorted(parts[2])})")
            attention, mlp = layer.self_attn, layer.mlp
            linears = [getattr(attention, n) for n in sorted(ATTENTION_PARTS)]
            linears += [getattr(mlp, n) for n in sorted(MLP_PARTS - {"act_fn"})]
            if not all(isinstance(linear, SkinnyLinear) and linear.kernel for linear in linears):
                return "a projection does not run on the CPU kernel (not float32, or not contiguous)"
            for group in ((attention.q_proj, attention.k_proj, attention.v_proj), (mlp.gate_proj, mlp.up_proj)):
                if len({linear.bias is None for linear in group}) > 1:
                    return "projections of one input where some have a bias and some not"
        return None

    @torch.inference_mode()
    def verify(self, like: KVPool, reference: Callable[[KVPool], Callable[..., torch.Tensor]]) -> str | None:
        """None if this step gives the same bits as `reference(pool)` (the HF layers' step): both run
        PROBE_STEPS greedy steps of PROBE_ROWS rows at different lengths, each over its own small pool shaped
        like `like`; else what differs."""
        layers, _, heads, _, dim = like.keys.shape
        pools = [KVPool(layers, heads, dim, slots=PROBE_ROWS, max_len=PROBE_LENGTH, dtype=like.keys.dtype,
                        device=like.keys.device) for _ in range(2)]
        for probe in pools:
            probe.readable(PROBE_ROWS, probe.columns)                                  # zeros: finite
        steps = [reference(pools[0]), lambda *inputs: self.logits(pools[1], *inputs)]
        vocab = self.model.get_output_embeddings().weight.shape[0]
        tokens = torch.arange(1, PROBE_ROWS + 1, device=like.keys.device) * 7 % vocab      # [rows]
        positions = torch.arange(PROBE_ROWS, device=like.keys.device) * 3                  # [rows]
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

    def logits(self, pool: KVPool, tokens: torch.Tensor, positions: torch.Tensor, key_columns: int) -> torch.Tensor:
        """tokens, positions [rows] (int64) → next-token logits [rows, V], as DecodeStepper.logits over `pool`."""
        rows = tokens.shape[0]
        hidden = self.decoder.embed_tokens(tokens)                                     # [rows, hidden]
        cos, sin = self.decoder.rotary_emb(hidden[:, None], position_ids=positions[:, None])   # [rows, 1, D]
        cos, sin = cos[:, 0], sin[:, 0]                                                # [rows, D]
        lengths = pool.row_lengths(positions)                                          # [rows]; 0: padding
        for index, layer in enumerate(self.layers):
            keys, values = pool.keys[index], pool.values[index]                        # [slots, Hkv, columns, D]
            query = cpu_kernels.rope_write(*self.qkv[index](layer.input_layernorm(hidden)), cos, sin, positions,
                                           keys, values)                                       # [rows, Hq, D]
            grouped = query.view(rows, keys.shape[1], -1, keys.shape[3])               # [rows, Hkv, G, D]
            out = cpu_kernels.decode_attention(grouped, keys[:rows, :, :key_columns], values[:rows, :, :key_columns],
                                               lengths, layer.self_attn.scaling)
            hidden = hidden + self.output[index](out.view(rows, -1))[0]
            # contiguous, as the HF layers' own outputs (the activation's vector loops then split them alike)
            gate, up = (part.contiguous() for part in self.gate_up[index](layer.post_attention_layernorm(hidden)))
            hidden = hidden + self.down[index](layer.mlp.act_fn(gate) * up)[0]
        return self.model.lm_head(self.decoder.norm(hidden))                          # [rows, V]
