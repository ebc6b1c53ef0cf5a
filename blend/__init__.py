"""blend: CacheBlend-style KV reuse on HF transformers.

Exports the model loader, the ChunkKV unit, the prompt layout, the Blender (precompute,
selective-recompute prefill, full prefill, decode) and sampling/streaming helpers.
Knows nothing about HTTP, FAISS or Redis.
"""
from blend.attention import BLEND_ATTENTION
from blend.chunk_kv import ChunkKV, KVMismatchError, hash_ids
from blend.decode import SamplingParams, TextStream
from blend.engine import Blender, Prefill, PrefillStats
from blend.model import LoadedModel, load_model
from blend.prompt import PromptFormat
from blend.rope import RopeShifter, RopeUnsupportedError

__all__ = ["BLEND_ATTENTION", "Blender", "ChunkKV", "KVMismatchError", "LoadedModel", "Prefill", "PrefillStats",
           "PromptFormat", "RopeShifter", "RopeUnsupportedError", "SamplingParams", "TextStream", "hash_ids",
           "load_model"]
