"""Store keys: sha256 over (model fingerprint, context hash, token ids), as 64 lowercase hex chars.

A key names exactly one KV: a different model, prompt head or token sequence gives a different
key. Tiers accept nothing but such keys, so no user-controlled text can reach a file path or a
Redis key pattern.
"""
from __future__ import annotations

import hashlib
import re

import numpy as np
import torch

_KEY_RE = re.compile(r"[0-9a-f]{64}")
_DOMAIN = b"ragblend-kv-key/1\x00"


def _field(text: str) -> bytes:
    # Length-prefixed so ("ab", "c") and ("a", "bc") can never hash alike.
    raw = text.encode("utf-8")
    return len(raw).to_bytes(8, "little") + raw


def kv_key(fingerprint: str, context_hash: str, token_ids: list[int] | torch.Tensor) -> str:
    """The store key of the KV of `token_ids` computed by model `fingerprint` after `context_hash`."""
    ids = token_ids.to(torch.int64).reshape(-1).numpy() if isinstance(token_ids, torch.Tensor) \
        else np.asarray(token_ids, dtype=np.int64)  # [T]; numpy: a plan hashes hundreds of spans
    h = hashlib.sha256(_DOMAIN)
    h.update(_field(fingerprint))
    h.update(_field(context_hash))
    h.update(ids.astype("<i8", copy=False).tobytes())  # last field: its length is what remains
    return h.hexdigest()


def is_key(key: object) -> bool:
    return isinstance(key, str) and _KEY_RE.fullmatch(key) is not None


def validate_key(key: str) -> str:
    """Return `key` if it is 64 lowercase hex chars, else raise ValueError."""
    if not is_key(key):
        raise ValueError(f"invalid store key {key!r:.80}: expected 64 lowercase hex chars")
    return key
