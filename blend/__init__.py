"""blend: CacheBlend-style KV reuse on HF transformers.

Exports the model loader, the ChunkKV unit, the prompt layout, the Blender (precompute,
selective-recompute prefill, full prefill), the DecodeRuntime (pooled, batched decode), the driver (requests
as data, the step, its runner), and sampling/streaming helpers.
Knows nothing about HTTP, FAISS or Redis.

The exports load lazily (PEP 562): importing the engine pulls in the HF modeling code (seconds),
which a caller that wants only ChunkKV (common.chunk_kv, re-exported here) never needs.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "BLEND_ATTENTION": "blend.attention",
    "ChunkKV": "common.chunk_kv", "KVMismatchError": "common.chunk_kv", "hash_ids": "common.chunk_kv",
    "SamplingParams": "blend.decode", "TextStream": "blend.decode", "TokenStream": "blend.decode",
    "Blender": "blend.blender", "Prefill": "blend.blender", "PrefillStats": "blend.blender",
    "StoredSpans": "blend.cache",
    "DecodeRuntime": "blend.runtime", "Runner": "blend.driver", "Step": "blend.driver", "schedule": "blend.driver",
    "LoadedModel": "blend.model", "load_model": "blend.model",
    "PromptFormat": "blend.prompt",
    "RopeShifter": "blend.rope", "RopeUnsupportedError": "blend.rope",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'blend' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # import once
    return value
