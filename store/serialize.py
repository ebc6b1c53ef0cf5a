"""ChunkKV <-> bytes: a self-checking binary format, readable one layer at a time. No pickle.

Layout (format v2; all integers and tensors little-endian):

    b"RBKV" | u32 header length | header (JSON, space-padded) | token_ids int64 [T] | layer 0 | ... | layer L-1

The header holds the format version, codec, source dtype, shape [L, H, T, D], model
fingerprint, context hash, position, `hash_ids` of the tokens, `layers`: one
[offset, length, sha256] per layer (offset from the end of the header), and `sha256`: a digest
over the header without that field plus the token ids. The header digest covers every layer's
digest, so the whole entry is checked by the header digest plus each layer's; a reader that wants
layer i alone needs the head (prefix, header, token ids) and layer i's bytes, nothing else
(sha256 rather than blake2b: with SHA-NI it is ~2x faster on the CPUs we run on).

The header is padded with spaces so the payload starts 8-aligned, and each layer section is
zero-padded to a multiple of 8 bytes (the padding is inside the section's digest, so every byte
of an entry is checked). A layer section holds, for one layer:

- ``fp16``: keys fp16 [H, T, D], values fp16 [H, T, D]. Decodes to float16, bit-exact to the
  input cast to float16.
- ``int8``: k_scale f32 [H, 1, D], v_scale f32 [H, T, 1], keys int8 [H, T, D], values int8
  [H, T, D]. Symmetric, quantized separately: keys get one scale per (layer, head, channel) over
  the tokens (K has outlier channels), values one per (layer, head, token) over the channels.
  scale = amax / 127 of the slice, q = round(x / scale). Decodes to float32 with
  |x - decoded| <= scale / 2 for every element (up to float32 rounding).

`decode` (whole entry) and `parse_head` + `decode_layer` (one layer at a time) check magic,
version, header schema, lengths, digests and (optionally) the fingerprint and raise
`CorruptEntryError` / `KVMismatchError`: they never return a wrong tensor. Entries of another
format version raise `OldFormatError`, a CorruptEntryError the store drops quietly.
"""
from __future__ import annotations

import hashlib
import json
import math
import struct
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from common.chunk_kv import ChunkKV, KVMismatchError, hash_ids

if sys.byteorder != "little":
    raise ImportError("the KV format is little-endian; big-endian hosts are not supported")

MAGIC = b"RBKV"
VERSION = 2
CODECS = ("fp16", "int8")
MAX_HEADER_BYTES = 64 << 10
_PREFIX = struct.Struct("<4sI")  # magic, header length
HEAD_BYTES = _PREFIX.size + MAX_HEADER_BYTES  # an entry's first HEAD_BYTES always hold its header
OPEN_BYTES = 16 << 10  # first read of an entry's head: a 30-layer, 1k-token chunk's header and ids fit
_ALIGN = 8
_HEADER_TYPES = {"v": int, "codec": str, "dtype": str, "shape": list, "fingerprint": str,
                 "context_hash": str, "position": int, "token_hash": str, "layers": list, "sha256": str}

Shape = tuple[int, int, int, int]  # [layers, kv_heads, T, head_dim]
Section = tuple[str, type, tuple[int, ...]]  # name, numpy dtype, shape


class CorruptEntryError(ValueError):
    """Serialized KV bytes are damaged, truncated, of another format version, or not a KV at all."""


class OldFormatError(CorruptEntryError):
    """A ragblend entry of another format version: not damaged, just unreadable by this build."""


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _layer_layout(codec: str, H: int, T: int, D: int) -> list[Section]:
    """One layer's sections in order; the f32 scales first keep every section aligned."""
    if codec == "fp16":
        return [("keys", np.float16, (H, T, D)), ("values", np.float16, (H, T, D))]
    if codec == "int8":
        return [("k_scale", np.float32, (H, 1, D)), ("v_scale", np.float32, (H, T, 1)),
                ("keys", np.int8, (H, T, D)), ("values", np.int8, (H, T, D))]
    raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}")


def layer_nbytes(codec: str, shape: Shape) -> int:
    """Bytes of one layer's section, padding included."""
    _, H, T, D = shape
    return _align(sum(math.prod(s) * np.dtype(dt).itemsize for _, dt, s in _layer_layout(codec, H, T, D)))


def _layer_offsets(codec: str, shape: Shape) -> list[tuple[int, int]]:
    """(offset from the payload start, length) of each layer; the token ids (int64) come first."""
    first, size = 8 * shape[2], layer_nbytes(codec, shape)
    return [(first + i * size, size) for i in range(shape[0])]


def payload_nbytes(codec: str, shape: Shape) -> int:
    return 8 * shape[2] + shape[0] * layer_nbytes(codec, shape)


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
    """The codec's tensors for all layers: each [L, ...], sliced per layer by `encode`."""
    if codec == "fp16":
        return {"keys": kv.keys.half(), "values": kv.values.half()}
    k_q, k_scale = quantize_int8(kv.keys, dim=2)  # keys: [L, H, T, D], k_scale: [L, H, 1, D]
    v_q, v_scale = quantize_int8(kv.values, dim=3)  # values: [L, H, T, D], v_scale: [L, H, T, 1]
    return {"keys": k_q, "values": v_q, "k_scale": k_scale, "v_scale": v_scale}


def _layer_views(codec: str, data: Any, offset: int, n: int, stride: int, H: int, T: int, D: int) -> dict:
    """Views over `n` consecutive layer sections of `data` (any buffer) starting at `offset`,
    `stride` bytes apart: each section name -> an array [n, ...] across those layers, no copy."""
    views, at = {}, offset
    for name, dtype, shape in _layer_layout(codec, H, T, D):
        item = np.dtype(dtype).itemsize
        inner = tuple(item * math.prod(shape[k + 1:]) for k in range(len(shape)))  # C order in a section
        views[name] = np.ndarray((n, *shape), dtype, buffer=data, offset=at, strides=(stride, *inner))
        at += item * math.prod(shape)
    return views


def _decode_into(codec: str, views: dict, keys: np.ndarray, values: np.ndarray) -> None:
    """Decode layer views into `keys` and `values` ([n, H, T, D] arrays), one numpy pass each.

    numpy rather than torch: it reads read-only buffers (bytes from a tier) without a copy or a
    warning, and releases the GIL for the copy, so a loader thread overlaps with the model.
    """
    if codec == "fp16":
        np.copyto(keys, views["keys"])
        np.copyto(values, views["values"])
    else:  # int8 * f32 -> f32
        np.multiply(views["keys"], views["k_scale"], out=keys)
        np.multiply(views["values"], views["v_scale"], out=values)


def decoded_dtype(codec: str) -> torch.dtype:
    return torch.float16 if codec == "fp16" else torch.float32


# --- format -----------------------------------------------------------------------------------

def _canonical(header: dict[str, Any]) -> bytes:
    return json.dumps(header, sort_keys=True, separators=(",", ":")).encode()


def _sha256(*parts: Any) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    return h.hexdigest()


def _header_digest(header: dict[str, Any], token_ids: Any) -> str:
    """sha256 over the header without its digest field, then the token ids."""
    return _sha256(_canonical({k: v for k, v in header.items() if k != "sha256"}), token_ids)


def encode(kv: ChunkKV, codec: str = "fp16") -> bytes:
    """Serialize `kv` with `codec` ("fp16" or "int8")."""
    shape = tuple(kv.keys.shape)
    L, H, T, D = shape
    packed = _pack(kv, codec)
    layout = _layer_layout(codec, H, T, D)
    size = layer_nbytes(codec, shape)
    token_ids = np.ascontiguousarray(kv.token_ids.detach().cpu().numpy(), dtype=np.int64).tobytes()
    sections = []
    for i in range(L):
        parts = [np.ascontiguousarray(packed[name][i].detach().cpu().numpy(), dtype=dtype).tobytes()
                 for name, dtype, _ in layout]
        raw = b"".join(parts)
        sections.append(raw + bytes(size - len(raw)))
    header = {"v": VERSION, "codec": codec, "dtype": str(kv.keys.dtype).removeprefix("torch."),
              "shape": list(shape), "fingerprint": kv.fingerprint, "context_hash": kv.context_hash,
              "position": int(kv.position), "token_hash": hash_ids(kv.token_ids),
              "layers": [[off, n, _sha256(s)] for (off, n), s in zip(_layer_offsets(codec, shape), sections)]}
    header["sha256"] = _header_digest(header, token_ids)
    head = _canonical(header)
    head += b" " * (_align(_PREFIX.size + len(head)) - _PREFIX.size - len(head))  # payload 8-aligned
    return b"".join([_PREFIX.pack(MAGIC, len(head)), head, token_ids, *sections])


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
        if type(header.get("v")) is int:
            raise OldFormatError(f"format version {header['v']}, this build reads {VERSION}")
        raise CorruptEntryError(f"format version {header.get('v')!r}, this build reads {VERSION}")
    for name, typ in _HEADER_TYPES.items():
        value = header.get(name)
        if not isinstance(value, typ) or isinstance(value, bool):
            raise CorruptEntryError(f"header field {name!r} missing or not {typ.__name__}")
    shape = header["shape"]
    if len(shape) != 4 or not all(type(n) is int and n >= 0 for n in shape) or header["codec"] not in CODECS:
        raise CorruptEntryError(f"bad shape {shape} or codec {header['codec']!r}")
    layers = header["layers"]
    expected = _layer_offsets(header["codec"], tuple(shape))
    if len(layers) != len(expected) or any(
            not isinstance(entry, list) or entry[:2] != list(where) or len(entry) != 3 or not isinstance(entry[2], str)
            for entry, where in zip(layers, expected)):
        raise CorruptEntryError("header's layer table does not match its codec and shape")
    return header, end


def read_header(data: bytes | memoryview) -> dict[str, Any]:
    """The header of an entry: cheap (needs only the entry's first bytes, no digest check)."""
    return _parse_header(data)[0]


@dataclass(frozen=True)
class EntryHead:
    """An entry's parsed and checked head (prefix, header, token ids): where each layer lies."""

    header: dict[str, Any]
    payload_start: int  # offset of the token ids from the start of the entry
    token_ids: torch.Tensor  # [T] int64

    @property
    def codec(self) -> str:
        return self.header["codec"]

    @property
    def shape(self) -> Shape:
        return tuple(self.header["shape"])

    @property
    def num_layers(self) -> int:
        return self.shape[0]

    @property
    def nbytes(self) -> int:
        """Length of the whole entry."""
        return self.payload_start + payload_nbytes(self.codec, self.shape)

    @property
    def head_nbytes(self) -> int:
        """Length of the head: the prefix, the header and the token ids."""
        return self.payload_start + 8 * self.shape[2]

    def layer_range(self, i: int) -> tuple[int, int]:
        """(offset from the start of the entry, length) of layer `i`'s section."""
        if not 0 <= i < self.num_layers:
            raise IndexError(f"layer {i} out of range: the entry has {self.num_layers} layers")
        offset, length, _ = self.header["layers"][i]
        return self.payload_start + offset, length


def head_nbytes(data: bytes | memoryview) -> int:
    """How many bytes from the entry's start `parse_head` needs, judged from what `data` holds.

    Grows as `data` does: the header end while the header is incomplete, then the head's length.
    Read that many bytes and ask again until it stops growing.
    """
    if len(data) < _PREFIX.size:
        return _PREFIX.size
    header_end = _PREFIX.size + _PREFIX.unpack_from(data)[1]
    if header_end > len(data) and header_end <= HEAD_BYTES:
        return header_end
    header, start = _parse_header(data)
    return start + 8 * header["shape"][2]


def parse_head(data: bytes | memoryview, expected_fingerprint: str | None = None, *,
               verify_checksum: bool = True) -> EntryHead:
    """Parse and check an entry's head from its first `head_nbytes` bytes (more are ignored)."""
    header, start = _parse_header(data)
    if expected_fingerprint is not None and header["fingerprint"] != expected_fingerprint:
        raise KVMismatchError(f"entry is for model {header['fingerprint']!r}, not {expected_fingerprint!r}")
    T = header["shape"][2]
    if start + 8 * T > len(data):
        raise CorruptEntryError(f"entry of {len(data)} bytes ends inside its token ids")
    ids = memoryview(data)[start:start + 8 * T]
    if verify_checksum and _header_digest(header, ids) != header["sha256"]:
        raise CorruptEntryError("header checksum mismatch")
    token_ids = torch.from_numpy(np.frombuffer(ids, np.int64).copy())
    return EntryHead(header, start, token_ids)


def decode_layer(head: EntryHead, i: int, section: bytes | memoryview, *, verify_checksum: bool = True,
                 pin_memory: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys [H, T, D], values [H, T, D]) of layer `i` from its section's bytes.

    `pin_memory` puts them in page-locked memory (for a non-blocking copy to a GPU; needs CUDA).
    Raises CorruptEntryError if the bytes are not the layer the header describes.
    """
    _, length = head.layer_range(i)
    if len(section) != length:
        raise CorruptEntryError(f"layer {i} is {len(section)} bytes, the header says {length}")
    if verify_checksum and _sha256(section) != head.header["layers"][i][2]:
        raise CorruptEntryError(f"layer {i} checksum mismatch")
    _, H, T, D = head.shape
    dtype = decoded_dtype(head.codec)
    keys = torch.empty((1, H, T, D), dtype=dtype, pin_memory=pin_memory)  # [1, H, T, D]
    values = torch.empty((1, H, T, D), dtype=dtype, pin_memory=pin_memory)  # [1, H, T, D]
    _decode_into(head.codec, _layer_views(head.codec, section, 0, 1, length, H, T, D), keys.numpy(), values.numpy())
    return keys[0], values[0]


def decode(data: bytes | memoryview, expected_fingerprint: str | None = None, *,
           verify_checksum: bool = True) -> ChunkKV:
    """Deserialize and check a whole entry. fp16 entries decode to float16, int8 ones to float32.

    `verify_checksum=False` skips only the digests (for bytes that never left this process).
    Raises CorruptEntryError for damaged data, KVMismatchError for another model's entry.
    """
    head = parse_head(data, expected_fingerprint, verify_checksum=verify_checksum)
    if len(data) != head.nbytes:
        raise CorruptEntryError(f"entry is {len(data)} bytes, its header implies {head.nbytes}")
    L, H, T, D = head.shape
    dtype = decoded_dtype(head.codec)
    keys = torch.empty((L, H, T, D), dtype=dtype)  # [L, H, T, D]
    values = torch.empty((L, H, T, D), dtype=dtype)  # [L, H, T, D]
    view = memoryview(data)
    for i in range(L if verify_checksum else 0):
        offset, length = head.layer_range(i)
        if _sha256(view[offset:offset + length]) != head.header["layers"][i][2]:
            raise CorruptEntryError(f"layer {i} checksum mismatch")
    if L:  # every layer in one pass: the sections are evenly spaced
        first, stride = head.layer_range(0)
        _decode_into(head.codec, _layer_views(head.codec, view, first, L, stride, H, T, D),
                     keys.numpy(), values.numpy())
    return ChunkKV(keys, values, head.token_ids, head.header["position"], head.header["context_hash"],
                   head.header["fingerprint"])
