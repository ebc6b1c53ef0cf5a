"""The CPU decode step without HF's per-op overhead: Llama-family layers run straight on the CPU kernels.

Through the HF decoder layers (blend.batch.LayerStep), a SmolLM2 step of one row spends ~18 of its ~50 ms
outside its linears and attention: ~1,750 small torch ops and the modules' Python, 30 layers of it. This
step runs each layer as one call, `cpu_kernels.decode_layer`: RMSNorm, the q/k/v projections as one product,
RoPE and the pool write, `decode_attention`, the output projection, RMSNorm, gate/up as one product, SiLU,
down and the two residual adds, in C (a layer's weights as the model holds them: float32, or quantised codes).
Only the embedding, RoPE's cos/sin, the final norm and the LM head run as the model's modules.

It does what the model's own layers do, in other kernels (its linears and attention in C, RoPE as the same
products and sums HF's uses), so it is held to what the model's own forward gives: `KernelStep.probe` runs a few
greedy steps of rows of different lengths, and a padding row, against the model's own forward over its own
cache, and accepts the step only if every row's logits are within blend.gate.judge's tolerance (twice the
model's own rounding spread, one piece against token by token, plus two ulps) with the same top token: the
start-up gate's rule for the blend loop, so one definition of "the same model" holds for the prefill and the
decode step. (Not bit for bit: the decode step it replaces runs sdpa, whose sums are ordered otherwise.)
SmolLM2's logits are within 2e-5 of its own forward's, its spread 5e-5 (tolerance 1.1e-4).
`KernelStep.refusal` names what keeps a model off it before any probe (layers that are not Llama's shape:
Qwen3's q/k norms, Gemma's extra norms; norms that are not Llama's RMSNorm; an activation other than SiLU;
weights the kernels do not take; a sliding window, which the kernel's attention does not apply). Those decode
through the model's layers (blend.batch.LayerStep).

Its pool keeps K/V in float16 (`KernelStep.pool_dtype`): a step streams every row's K/V, and at half the bytes,
widened in registers, a SmolLM2 step's attention at 3.1k keys takes 3.2-5.1 ms against 6-8 ms over float32 (30
layers, one row; the int4 step ~14-17 ms).
The probe checks the step's math over a float32 pool; the kernels read float16 as the same floats, so over the
float16 pool the step is the model over its K/V rounded to float16 (as llama.cpp's default cache; the prompt's
first token comes from its prefill, in float32).
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache

from blend import cpu_kernels
from blend.gate import judge, sliding_window, tolerance
from blend.pool import KVPool
from blend.quantized import QuantizedLinear
from blend.skinny import SkinnyLinear

LAYER_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
ATTENTION_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj"}
MLP_PARTS = {"gate_proj", "up_proj", "down_proj", "act_fn"}
SILU = {"SiLU", "SiLUActivation"}  # torch's and transformers' modules of the activation decode_layer computes
PROBE_PROMPTS, PROBE_STEPS = (5, 11), 3   # the probe's rows (their prompt lengths; one more row pads), its steps


def projection_weights(*linears: SkinnyLinear) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Linears of one input as cpu_kernels.decode_layer takes them: their weights where they are (the model keeps
    its memory: its file's pages, when loaded mapped), float32 [w₀, w₁, ..] or quantised (codes, scales[, mins])
    per linear (blend.quantized), and their biases as one [Σ out] (None without)."""
    if isinstance(linears[0], QuantizedLinear):  # all or none, of one width (KernelStep.refusal)
        parts = ("codes", "scales", "mins") if linears[0].bits == 4 else ("codes", "scales")
        weights = [getattr(linear, part) for linear in linears for part in parts]
    else:
        weights = [linear.weight for linear in linears]
    has_bias = linears[0].bias is not None  # all or none (KernelStep.refusal)
    return weights, torch.cat([linear.bias for linear in linears]) if has_bias else None


def layer_arguments(layer: nn.Module) -> tuple:
    """A Llama-shaped layer's own arguments to cpu_kernels.decode_layer (its norms, projections and biases)."""
    attention, mlp = layer.self_attn, layer.mlp
    qkv, qkv_bias = projection_weights(attention.q_proj, attention.k_proj, attention.v_proj)
    output, output_bias = projection_weights(attention.o_proj)
    gate_up, gate_up_bias = projection_weights(mlp.gate_proj, mlp.up_proj)
    down, down_bias = projection_weights(mlp.down_proj)
    return (layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
            layer.input_layernorm.variance_epsilon, qkv, output, gate_up, down,
            [qkv_bias, output_bias, gate_up_bias, down_bias], attention.q_proj.out_features,
            attention.k_proj.out_features)


class KernelStep:
    """A decode step's forward for Llama-shaped layers on the CPU kernels, over any pool shaped for the model."""

    reads_masked_keys = False  # the attention kernel reads no key past a row's own
    # The decode pool's elements: K/V in float16 halve the bytes a step streams (llama.cpp's default cache too).
    # The probe holds the step's math to the model's own forward over a pool of the model's dtype; the kernels
    # read float16 elements as those same floats and write a float rounded to the nearest (tests/blend/
    # test_cpu_kernels.py), so over this pool the step is the model over its K/V stored in float16.
    pool_dtype = torch.float16

    def __init__(self, model: nn.Module):
        self.model, self.decoder = model, model.model
        self.layers = list(self.decoder.layers)
        self.arguments = [layer_arguments(layer) for layer in self.layers]

    @classmethod
    def for_model(cls, model: nn.Module) -> tuple[KernelStep | None, str | None]:
        """(the kernel step, None) where `model` passes `refusal` and `probe`, else (None, why not)."""
        reason = cls.refusal(model)
        if reason is not None:
            return None, reason
        step = cls(model)
        reason = step.probe()
        return (None, reason) if reason else (step, None)

    @staticmethod
    def refusal(model: nn.Module) -> str | None:
        """Why `model`'s decoder layers cannot run as a KernelStep (None: they can, if `probe` agrees)."""
        if sliding_window(model) is not None:
            return "the model has a sliding window, which the kernel step's attention does not apply"
        for layer in model.model.layers:
            modules = (layer, getattr(layer, "self_attn", nn.Module()), getattr(layer, "mlp", nn.Module()))
            parts = [{name for name, _ in module.named_children()} for module in modules]
            if parts != [LAYER_PARTS, ATTENTION_PARTS, MLP_PARTS]:
                return (f"{type(layer).__name__} is not a Llama-shaped layer (parts {sorted(parts[0])}, attention "
                        f"{sorted(parts[1])}, MLP {sorted(parts[2])})")
            attention, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if not all(hasattr(norm, "variance_epsilon") and getattr(norm, "weight", None) is not None
                       for norm in norms):
                return f"{type(norms[0]).__name__} is not Llama's RMSNorm (a weight and variance_epsilon)"
            if type(mlp.act_fn).__name__ not in SILU:
                return f"the MLP's activation is {type(mlp.act_fn).__name__}, not SiLU"
            linears = [getattr(attention, n) for n in sorted(ATTENTION_PARTS)]
            linears += [getattr(mlp, n) for n in sorted(MLP_PARTS - {"act_fn"})]
            if not all(isinstance(linear, SkinnyLinear) and linear.kernel for linear in linears):
                return "a projection does not run on the CPU kernel (not float32, or not contiguous)"
            for group in ((attention.q_proj, attention.k_proj, attention.v_proj), (mlp.gate_proj, mlp.up_proj)):
                if len({linear.bias is None for linear in group}) > 1:
                    return "projections of one input where some have a bias and some not"
            if len({getattr(linear, "bits", 32) for linear in group}) > 1:
                return "projections of one input whose weights are in different forms"
        return None

    @torch.inference_mode()
    def probe(self) -> str | None:
        """None if this step reproduces the model's own forward (see the module docstring), else what differs.
        Rows of PROBE_PROMPTS tokens, and a padding row, decode PROBE_STEPS greedy steps over a small pool
        holding the prompts' K/V from the model's own forward; each step's logits are judged against that
        forward's, run token by token over its own cache."""
        model = self.model
        device = next(model.parameters()).device
        vocab = model.get_output_embeddings().weight.shape[0]
        prompts = [[(7 * i + 3 * row + 1) % vocab for i in range(n)] for row, n in enumerate(PROBE_PROMPTS)]
        config = model.config.get_text_config(decoder=True)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        pool = KVPool(len(self.layers), config.num_key_value_heads, head_dim, slots=len(prompts) + 1,
                      max_len=max(PROBE_PROMPTS) + PROBE_STEPS, dtype=next(model.parameters()).dtype, device=device)
        references = [self._own_forward(ids, pool, slot, device) for slot, ids in enumerate(prompts)]
        spread = max(spread for _, _, spread in references)
        for step in range(PROBE_STEPS):
            tokens = torch.tensor([tokens[step] for tokens, _, _ in references] + [0], device=device)
            positions = torch.tensor([len(ids) + step for ids in prompts] + [pool.scratch], device=device)
            try:
                got = self.logits(pool, tokens, positions, pool.columns).float().cpu()       # [rows + 1, V]
            except Exception as exc:  # noqa: BLE001 - a kernel that refuses these weights: not this step
                return f"the probe did not run: {type(exc).__name__}: {exc}"
            for row, (_, want, _) in enumerate(references):
                error, scale = float((got[row] - want[step]).abs().max()), float(want[step].abs().max())
                top1_equal = bool(got[row].argmax() == want[step].argmax())
                if not judge(error, spread, top1_equal, pool.keys.dtype, scale):
                    return (f"the kernel step does not reproduce the model's own forward on a probe (max |logit "
                            f"difference| {error:.3g}, over {tolerance(spread, pool.keys.dtype, scale):.3g} allowed; "
                            f"top-1 {'equal' if top1_equal else 'differs'})")
        return None

    def _own_forward(self, ids: list[int], pool: KVPool, slot: int, device: torch.device
                     ) -> tuple[list[int], torch.Tensor, float]:
        """The model's own forward over `ids` (its K/V then loaded into the pool's `slot`), then PROBE_STEPS greedy
        tokens fed one at a time over its own cache: (the tokens fed, their logits [steps, V], the spread between
        those logits and the same positions' in one piece)."""
        model, cache = self.model, DynamicCache()
        out = model(input_ids=torch.tensor([ids], device=device), cache=cache, use_cache=True)
        pool.load(slot, [(layer.keys, layer.values) for layer in cache.layers])
        tokens, logits = [int(out.logits[0, -1].argmax())], []
        for step in range(PROBE_STEPS):
            out = model(input_ids=torch.tensor([[tokens[-1]]], device=device), cache=cache, use_cache=True,
                        position_ids=torch.tensor([[len(ids) + step]], device=device))
            logits.append(out.logits[0, -1].float().cpu())
            tokens.append(int(logits[-1].argmax()))
        whole = model(input_ids=torch.tensor([ids + tokens[:-1]], device=device)).logits[0, len(ids):].float().cpu()
        logits = torch.stack(logits)                                                    # [steps, V]
        return tokens, logits, float((logits - whole).abs().max())

    def logits(self, pool: KVPool, tokens: torch.Tensor, positions: torch.Tensor, key_columns: int) -> torch.Tensor:
        """tokens, positions [rows] (int64) → next-token logits [rows, V], as LayerStep.logits over `pool`."""
        hidden = self.decoder.embed_tokens(tokens)                                     # [rows, hidden]
        cos, sin = self.decoder.rotary_emb(hidden[:, None], position_ids=positions[:, None])   # [rows, 1, D]
        cos, sin = cos[:, 0], sin[:, 0]                                                # [rows, D]
        lengths = pool.row_lengths(positions)                                          # [rows]; 0: padding
        for index, layer in enumerate(self.layers):
            hidden = cpu_kernels.decode_layer(hidden, *self.arguments[index], cos, sin, positions, lengths,
                                              pool.keys[index], pool.values[index], key_columns,
                                              layer.self_attn.scaling)                        # [rows, hidden]
        return self.model.lm_head(self.decoder.norm(hidden))                          # [rows, V]
