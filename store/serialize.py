"""ChunkKV <-> bytes: a small self-checking binary format with two codecs. No pickle.

Layout (all integers and tensors little-endian):

    b"RBKV" | u32 header length | header (compact, key-sorted JSON) | payload (raw tensor bytes)

The header holds the format version, codec, source dtype, shape [L, H, T, D], model
fingerprint, context hash, position, `hash_ids` of the tokens, and `sha256`: a digest over the
header without that field plus the payload, so a flipped bit anywhere changes the digest
(sha256 rather than blake2b: with SHA-NI it is ~2x faster on the CPUs we run on).

The payload is a fixed list of sections that `_layout(codec, shape)` derives from the header,
so its length is known before a byte of it is read:

- ``fp16``: token_ids int64 [T], keys fp16 [L, H, T, D], values fp16 [L, H, T, D].
  Decodes to float16, bit-exact to the input cast to float16.
- ``int8``: token_ids int64 [T], k_scale f32 [L, H, 1, D], v_scale f32 [L, H, T, 1],
  keys int8 [L, H, T, D], values int8 [L, H, T, D]. Symmetric, quantized separately: keys get
  one scale per (layer, head, channel) over the tokens (K has outlier channels), values one per
  (layer, head, token) over the channels. scale = amax / 127 of the slice, q = round(x / scale).
  Decodes to float32 with |x - decoded| <= scale / 2 for every element (up to float32 rounding).

`decode` checks magic, version, header schema, lengths, digest and (optionally) the fingerprint
and raises `CorruptEntryError` / `KVMismatchError`: it never returns a wrong tensor.
"""
from __future__ import annotations

import hashlib
import json
import math
import struct
import sys
from typing import Any

import numpy as np
import torch

from blend.chunk_kv import ChunkKV, KVMismatchError, hash_ids

if sys.byteorder != "little":
    raise ImportError("the KV format is little-endian; big-endian hosts are not supported")

MAGIC = b"RBKV"
VERSION = 1
CODECS = ("fp16", "int8")
MAX_HEADER_BYTES = 64 << 10
_PREFIX = struct.Struct("<4sI")  # magic, header length
HEAD_BYTES = _PREFIX.size + MAX_HEADER_BYTES  # an entry's first HEAD_BYTES always hold its header
_HEADER_TYPES = {"v": int, "codec": str, "dtype": str, "shape": list, "fingerprint": str,
                 "context_hash": str, "position": int, "token_hash": str, "sha256": str}

Shape = tuple[int, int, int, int]  # [layers, kv_heads, T, head_dim]
Section = tuple[str, type, tuple[int, ...]]  # name, numpy dtype, shape


class CorruptEntryError(ValueError):
    """Serialized KV bytes are damaged, truncated, of another format version, or not a KV at all."""


def _layout(codec: str, shape: Shape) -> list[Section]:
    """The payload sections of `codec` in order; int64 and f32 sections first keep them aligned."""
    L, H, T, D = shape
    if codec == "fp16":
        return [("token_ids", np.int64, (T,)), ("keys", np.float16, (L, H, T, D)),
                ("values", np.float16, (L, H, T, D))]
    if codec == "int8":
        return [("token_ids", np.int64, (T,)), ("k_scale", np.float32, (L, H, 1, D)),
                ("v_scale", np.float32, (L, H, T, 1)), ("keys", np.int8, (L, H, T, D)),
                ("values", np.int8, (L, H, T, D))]
    raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}")


def payload_nbytes(codec: str, shape: Shape) -> int:
    return sum(math.prod(s) * np.dtype(dt).itemsize for _, dt, s in _layout(codec, shape))


def bytes_per_token(codec: str, shape: Shape) -> int:
    """Payload bytes per token (rounded up) of a chunk of `shape`, per-chunk scales included."""
    return math.ceil(payload_nbytes(codec, shape) / max(shape[2], 1))


# --- codecs -----------------------------------------------------------------------------------

def quantize_int8(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one float32 scale per slice reduced over `dim` (kept as size 1)."""
    x = x.float()
    scale = x.abs().amax(dim=dim, keepdim=True) / 127
    if not torch.isfinite(scale).all():  # amax propagates inf/nan, so this checks every element
        raise ValueError("cannot int8-encode a KV holding inf or nan")
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero slice: any scale is exact
    q = torch.round(x / scale).clamp_(-127, 127).to(torch.int8)
    return q, scale


def _pack(kv: ChunkKV, codec: str) -> dict[str, torch.Tensor]:
    if codec == "fp16":
        return {"keys": kv.keys.half(), "values": kv.values.half()}
    k_q, k_scale = quantize_int8(kv.keys, dim=2)  # keys: [L, H, T, D], k_scale: [L, H, 1, D]
    v_q, v_scale = quantize_int8(kv.values, dim=3)  # values: [L, H, T, D], v_scale: [L, H, T, 1]
    return {"keys": k_q, "values": v_q, "k_scale": k_scale, "v_scale": v_scale}


def _unpack(codec: str, s: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    if codec == "fp16":
        return s["keys"], s["values"]
    return s["keys"] * s["k_scale"], s["values"] * s["v_scale"]  # int8 * f32 -> f32, one pass


# --- format -----------------------------------------------------------------------------------

def _canonical(header: dict[str, Any]) -> bytes:
    return json.dumps(header, sort_keys=True, separators=(",", ":")).encode()


def _digest(header: dict[str, Any], payload: list) -> str:
    """sha256 over the header without its digest field, then the payload sections."""
    h = hashlib.sha256(_canonical({k: v for k, v in header.items() if k != "sha256"}))
    for part in payload:
        h.update(part)
    return h.hexdigest()


def encode(kv: ChunkKV, codec: str = "fp16") -> bytes:
    """Serialize `kv` with `codec` ("fp16" or "int8")."""
    shape = tuple(kv.keys.shape)
    sections = _pack(kv, codec) | {"token_ids": kv.token_ids}
    arrays = [np.ascontiguousarray(sections[name].detach().cpu().numpy(), dtype=dtype)
              for name, dtype, _ in _layout(codec, shape)]
    header = {"v": VERSION, "codec": codec, "dtype": str(kv.keys.dtype).removeprefix("torch."),
              "shape": list(shape), "fingerprint": kv.fingerprint, "context_hash": kv.context_hash,
              "position": int(kv.position), "token_hash": hash_ids(kv.token_ids)}
    header["sha256"] = _digest(header, arrays)
    head = _canonical(header)
    return b"".join([_PREFIX.pack(MAGIC, len(head)), head, *arrays])


def _parse_header(data: bytes | memoryview) -> tuple[dict[str, Any], int]:
    """(header, payload offset); checks magic, version and the header schema."""
    if len(data) < _PREFIX.size:
        raise CorruptEntryError(f"entry of {len(data)} bytes is too short")
    magic, size = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise CorruptEntryError("bad magic: not a ragblend KV entry")
    end = _PREFIX.size + size
    if size > MAX_HEADER_BYTES or end > len(data):
        raise CorruptEntryError(f"header length {size} does not fit an entry of {len(data)} bytes")
    try:
        header = json.loads(bytes(data[_PREFIX.size:end]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptEntryError(f"unreadable header: {exc}") from None
    if not isinstance(header, dict):
        raise CorruptEntryError("header is not a JSON object")
    if header.get("v") != VERSION:
        raise CorruptEntryError(f"format version {header.get('v')!r}, this build reads {VERSION}")
    for name, typ in _HEADER_TYPES.items():
        value = header.get(name)
        if not isinstance(value, typ) or isinstance(value, bool):
            raise CorruptEntryError(f"header field {name!r} missing or not {typ.__name__}")
    shape = header["shape"]
    if len(shape) != 4 or not all(type(n) is int and n >= 0 for n in shape) or header["codec"] not in CODECS:
        raise CorruptEntryError(f"bad shape {shape} or codec {header['codec']!r}")
    return header, end


def read_header(data: bytes | memoryview) -> dict[str, Any]:
    """The header of an entry: cheap (needs only the entry's first bytes, no digest check)."""
    return _parse_header(data)[0]


def decode(data: bytes | memoryview, expected_fingerprint: str | None = None, *,
           verify_checksum: bool = True) -> ChunkKV:
    """Deserialize and check an entry. fp16 entries decode to float16, int8 ones to float32.

    `verify_checksum=False` skips only the digest (for bytes that never left this process).
    Raises CorruptEntryError for damaged data, KVMismatchError for another model's entry.
    """
    header, start = _parse_header(data)
    if expected_fingerprint is not None and header["fingerprint"] != expected_fingerprint:
        raise KVMismatchError(f"entry is for model {header['fingerprint']!r}, not {expected_fingerprint!r}")
    layout = _layout(header["codec"], tuple(header["shape"]))
    payload = memoryview(data)[start:]
    if len(payload) != payload_nbytes(header["codec"], tuple(header["shape"])):
        raise CorruptEntryError(f"payload is {len(payload)} bytes, header implies "
                                f"{payload_nbytes(header['codec'], tuple(header['shape']))}")
    if verify_checksum and _digest(header, [payload]) != header["sha256"]:
        raise CorruptEntryError("checksum mismatch")
    buf = bytearray(payload)  # one copy: the tensors own it, so callers may write to them
    sections, offset = {}, 0
    for name, dtype, shape in layout:
        count = math.prod(shape)
        sections[name] = torch.from_numpy(np.frombuffer(buf, dtype, count, offset).reshape(shape))
        offset += count * np.dtype(dtype).itemsize
    keys, values = _unpack(header["codec"], sections)
    return ChunkKV(keys, values, sections["token_ids"], header["position"], header["context_hash"],
                   header["fingerprint"])
