"""ChunkKV: one chunk's precomputed keys and values, the unit the store saves and the blender reuses."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


def hash_ids(token_ids: list[int] | torch.Tensor) -> str:
    """sha256 of a token-id sequence (little-endian int64), hex."""
    ids = torch.as_tensor(token_ids, dtype=torch.int64).contiguous()
    return hashlib.sha256(ids.numpy().tobytes()).hexdigest()


class KVMismatchError(ValueError):
    """A ChunkKV does not belong to this model or prompt (fingerprint, shape or token mismatch)."""


@dataclass
class ChunkKV:
    """Keys and values of one chunk for every layer.

    keys/values: [layers, kv_heads, T, head_dim]; keys are RoPE-rotated for positions
    `position .. position + T - 1`. `context_hash` is `hash_ids` of the tokens the chunk was
    computed after (the prompt head, or nothing): a chunk placed right after exactly that
    context is bit-for-bit what a full prefill would produce.
    """

    keys: torch.Tensor
    values: torch.Tensor
    token_ids: torch.Tensor  # [T] int64
    position: int
    context_hash: str
    fingerprint: str

    def __post_init__(self) -> None:
        self.token_ids = torch.as_tensor(self.token_ids, dtype=torch.int64)
        if self.keys.dim() != 4 or self.keys.shape != self.values.shape:
            raise KVMismatchError(
                f"keys {tuple(self.keys.shape)} and values {tuple(self.values.shape)} must both be "
                "[layers, kv_heads, T, head_dim]"
            )
        if self.keys.shape[2] != self.token_ids.numel():
            raise KVMismatchError(f"KV holds {self.keys.shape[2]} tokens but token_ids has {self.token_ids.numel()}")

    @property
    def num_tokens(self) -> int:
        return self.token_ids.numel()

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def to(self, dtype: torch.dtype) -> ChunkKV:
        return ChunkKV(self.keys.to(dtype), self.values.to(dtype), self.token_ids, self.position,
                       self.context_hash, self.fingerprint)
