"""The model gate: can the blend loop run this model exactly?

The blend loop (blend.blender) embeds tokens, calls the model's decoder layers one by one with
its own attention (blend.attention) and applies the final norm and lm_head itself. That is exact
for Llama-like decoders and wrong, silently, for models whose forward does more: logit
softcapping (Gemma-2), a sliding window (Mistral, some Qwen2) once the prompt is longer than it,
chunked attention, multipliers applied outside the layers (Granite), a RoPE that cannot be
shifted (blend.rope). These checks say why a model cannot blend; the Blender then runs full
prefill through the model's own forward (and still decodes through the KV pool: blend.runtime). The Blender
adds a last check the config cannot give: a probe prompt through the loop must reproduce the model's own
logits, judged (`judge`) against the model's own rounding in its dtype on its device: its forward in one piece
vs in two pieces. `judge` is also the verdict on the CPU's kernel step (blend.kernel_step's probe).
"""
from __future__ import annotations

import inspect

import torch
from transformers import PreTrainedModel

DECODER_PARTS = ("embed_tokens", "layers", "norm", "rotary_emb")
LAYER_ARGS = ("hidden_states", "position_ids", "cache", "position_embeddings")
LAYER_TYPES = {"full_attention", "sliding_attention"}  # sliding layers are handled by the window check


def static_refusal(model: PreTrainedModel) -> str | None:
    """Why the config or structure rules blending out (None when nothing does)."""
    decoder = getattr(model, "model", None)
    missing = [part for part in DECODER_PARTS if not hasattr(decoder, part)]
    missing += [] if hasattr(model, "lm_head") else ["lm_head"]
    if missing:
        return f"{type(model).__name__} is not a Llama-like decoder (no {', '.join(missing)})"
    layer = type(decoder.layers[0])
    params = inspect.signature(layer.forward).parameters
    lacking = [arg for arg in LAYER_ARGS if arg not in params]
    if lacking or not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        needs = ", ".join(lacking) or "**kwargs"
        return f"{layer.__name__}.forward does not take {needs} as the blend loop passes them"
    config = model.config.get_text_config(decoder=True)
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, name, None) is not None:
            return f"{name}={getattr(config, name)}: the blend loop does not apply logit softcapping"
    other = set(getattr(config, "layer_types", None) or ()) - LAYER_TYPES
    if other:
        return f"layer types {sorted(other)} are not handled by the blend attention"
    return None


def sliding_window(model: PreTrainedModel) -> int | None:
    """Keys a query sees in the model's sliding-window layers (None when every layer sees the whole prompt)."""
    config = model.config.get_text_config(decoder=True)
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


# The probe's verdict. The loop's logits may differ from the model's own forward by about what the
# model's own forward differs from itself when the same tokens are split differently (its rounding in
# this dtype on this device); twice that is rounding, more is a loop that computes something else.
SPREAD_MULTIPLE = 2.0
# The model's own spread can be 0 (the same kernels in the same order, as on the CPU): a floor of a few
# rounding steps (ulps) of the logits' size keeps the gate from refusing the last bit of a different sum.
# Measured on the tiny test models: the real loop is within 1.3 ulps in bfloat16 (7 in float32); a key
# shifted one position too far, or an attention scale 10% off, is 3 ulps or more in bfloat16.
FLOOR_ULPS = 2.0


def tolerance(spread: float, dtype: torch.dtype, scale: float = 1.0) -> float:
    """The largest |logit difference| `judge` accepts: SPREAD_MULTIPLE times the model's own spread plus
    FLOOR_ULPS rounding steps of `dtype` at the logits' size `scale` (max |logit|)."""
    return SPREAD_MULTIPLE * spread + FLOOR_ULPS * torch.finfo(dtype).eps * max(1.0, scale)


def judge(error: float, spread: float, top1_equal: bool, dtype: torch.dtype, scale: float = 1.0) -> bool:
    """Whether a loop whose logits are `error` (max |Δ|) from the model's own, with the same top token
    (`top1_equal`), reproduces a model whose own forward differs from itself by `spread`."""
    return top1_equal and error <= tolerance(spread, dtype, scale)
