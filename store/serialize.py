"""ChunkKV <-> bytes: a self-checking binary format, readable one layer at a time. No pickle.

Layout (format v3; all integers and tensors little-endian):

    b"RBKV" | u32 header length | header (JSON, space-padded) | token_ids int64 [T] | layer 0 | ... | layer L-1

The header holds the format version, codec, the model's dtype, shape [L, H, T, D], model
fingerprint, context hash, position, `token_hash` of the tokens, `layers`: one
[offset, length, xxh3-128] per layer (offset from the end of the header), and `digest`: xxh3-128
over the header without that field plus the token ids. The header digest covers every layer's
digest, so a reader that wants layer i alone needs the head (prefix, header, token ids) and layer
i's bytes, nothing else. xxh3-128 (~10 GB/s on one core) checks integrity against damage, not
an adversary: keys, which name content, stay sha256.

The header is padded with spaces so the payload starts 8-aligned, and each layer section is
zero-padded to a multiple of 8 bytes (inside the section's digest, so every byte is checked).

Each layer section is one codec's (store/codecs.py: native, fp16, int8, int4, cachegen). A
fixed-size codec's sections have a length that follows from the shape; an entropy-coded codec's
(cachegen) vary, and its header names the probability tables that decode them (`tables`).

`decode` (whole entry) and `parse_head` + `decode_layer` check magic, version, header schema,
lengths, digests and (optionally) the fingerprint and raise `CorruptEntryError` /
`KVMismatchError`: they never return a wrong tensor. Entries of another format version, or
coded with cachegen tables this process does not hold, raise `OldFormatError`, a CorruptEntryError
the store drops quietly (and the chunk is recomputed).
"""
from __future__ import annotations

import json
import math
import struct
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from common.chunk_kv import ChunkKV, KVMismatchError, hash_ids
from store.codecs import (
    CODEC_NAMES,
    CODECS,
    Codec,
    CorruptEntryError,
    Device,
    OldFormatError,
    _on_host,
    get_codec,
    host_to,
)

__all__ = ["CODECS", "CODEC_NAMES", "Codec", "CorruptEntryError", "OldFormatError", "get_codec", "host_to"]

if sys.byteorder != "little":
    raise ImportError("the KV format is little-endian; big-endian hosts are not supported")

MAGIC = b"RBKV"
VERSION = 3
MAX_HEADER_BYTES = 64 << 10
_PREFIX = struct.Struct("<4sI")  # magic, header length
HEAD_BYTES = _PREFIX.size + MAX_HEADER_BYTES  # an entry's first HEAD_BYTES always hold its header
OPEN_BYTES = 16 << 10  # first read of an entry's head: a 30-layer, 1k-token chunk's header and ids fit
_ALIGN = 8
_HEADER_TYPES = {"v": int, "codec": str, "dtype": str, "shape": list, "fingerprint": str,
                 "context_hash": str, "position": int, "token_hash": str, "layers": list, "digest": str}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

Shape = tuple[int, int, int, int]  # [layers, kv_heads, T, head_dim]


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def digest(data: Any) -> str:
    """xxh3-128 of a buffer (bytes, memoryview, a contiguous numpy array), hex."""
    return xxhash.xxh3_128_hexdigest(data)


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"cannot store KV of dtype {dtype}; expected one of {sorted(DTYPES)}")
    return name


def layer_nbytes(codec: str, shape: Shape, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of one layer's section, padding included (a fixed-size codec's)."""
    _, H, T, D = shape
    parts = get_codec(codec).layout(dtype, H, T, D)
    return _align(sum(math.prod(s) * dt.itemsize for _, dt, s in parts))


def payload_nbytes(codec: str, shape: Shape, dtype: torch.dtype = torch.float32) -> int:
    return 8 * shape[2] + shape[0] * layer_nbytes(codec, shape, dtype)


def bytes_per_token(codec: str, shape: Shape, dtype: torch.dtype = torch.float32) -> int:
    """Payload bytes per token (rounded up) of a chunk of `shape` in `dtype`, per-chunk scales included
    (a fixed-size codec's; an entropy-coded entry's depend on its data: measure `len(encode(...))`)."""
    return math.ceil(payload_nbytes(codec, shape, dtype) / max(shape[2], 1))


# --- format -----------------------------------------------------------------------------------

def _canonical(header: dict[str, Any]) -> bytes:
    return json.dumps(header, sort_keys=True, separators=(",", ":")).encode()


def _header_digest(header: dict[str, Any], token_ids: Any) -> str:
    """xxh3-128 over the header without its digest field, then the token ids."""
    h = xxhash.xxh3_128(_canonical({k: v for k, v in header.items() if k != "digest"}))
    h.update(token_ids)
    return h.hexdigest()


def encode(kv: ChunkKV, codec: str | Codec = "fp16") -> bytes:
    """Serialize `kv` with `codec` (a name of CODECS, or a Codec: cachegen's as `register_tables` gives it)."""
    c = codec if isinstance(codec, Codec) else get_codec(codec)
    shape = tuple(kv.keys.shape)
    dtype_name = _dtype_name(kv.keys.dtype)
    token_ids = kv.token_ids.to(torch.int64).contiguous().numpy().tobytes()
    sections = [raw + bytes(_align(len(raw)) - len(raw)) for raw in c.sections(kv.keys, kv.values)]
    offsets = np.cumsum([len(token_ids), *(len(s) for s in sections)]).tolist()
    header = {"v": VERSION, "codec": c.name, **c.header_fields(), "dtype": dtype_name,
              "shape": list(shape), "fingerprint": kv.fingerprint, "context_hash": kv.context_hash,
              "position": int(kv.position), "token_hash": hash_ids(kv.token_ids),
              "layers": [[off, len(s), digest(s)] for off, s in zip(offsets, sections)]}
    header["digest"] = _header_digest(header, token_ids)
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
    if (len(shape) != 4 or not all(type(n) is int and n >= 0 for n in shape) or header["codec"] not in CODEC_NAMES
            or header["dtype"] not in DTYPES):
        raise CorruptEntryError(f"bad shape {shape}, codec {header['codec']!r} or dtype {header['dtype']!r}")
    codec = get_codec(header["codec"])  # cachegen without its tables: enough to know its sections vary
    if not codec.fixed_size and not isinstance(header.get("tables"), str):
        raise CorruptEntryError(f"a {codec.name} header must name its tables")
    layers, at = header["layers"], 8 * shape[2]  # the layers follow the token ids, back to back
    size = layer_nbytes(codec.name, tuple(shape), DTYPES[header["dtype"]]) if codec.fixed_size else None
    if len(layers) != shape[0]:
        raise CorruptEntryError("header's layer table does not match its shape")
    for entry in layers:
        if (not isinstance(entry, list) or len(entry) != 3 or entry[0] != at or type(entry[1]) is not int
                or entry[1] % _ALIGN or entry[1] < 0 or (size is not None and entry[1] != size)
                or not isinstance(entry[2], str)):
            raise CorruptEntryError("header's layer table does not match its codec and shape")
        at += entry[1]
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
    coder: Codec  # what decodes its layers (cachegen: with the tables the header names)

    @property
    def codec(self) -> str:
        return self.header["codec"]

    @property
    def dtype(self) -> torch.dtype:
        """The model's dtype: what layers decode to."""
        return DTYPES[self.header["dtype"]]

    @property
    def shape(self) -> Shape:
        return tuple(self.header["shape"])

    @property
    def num_layers(self) -> int:
        return self.shape[0]

    @property
    def nbytes(self) -> int:
        """Length of the whole entry."""
        offset, length, _ = self.header["layers"][-1] if self.num_layers else (8 * self.shape[2], 0, None)
        return self.payload_start + offset + length

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

    def check_layer(self, i: int, section: Any) -> None:
        """Raise CorruptEntryError unless `section` (a buffer) is layer i's bytes."""
        _, length = self.layer_range(i)
        if len(memoryview(section).cast("B")) != length:
            size = len(memoryview(section).cast("B"))
            raise CorruptEntryError(f"layer {i} is {size} bytes, the header says {length}")
        if digest(section) != self.header["layers"][i][2]:
            raise CorruptEntryError(f"layer {i} checksum mismatch")

    def layer_parts(self, i: int, section: torch.Tensor) -> dict[str, torch.Tensor]:
        """Layer i's parts, on the host, from its checked section (uint8 tensor): views, or an entropy-coded
        layer's decoded symbols (the costly step, so a store runs it on its read threads)."""
        _, H, T, D = self.shape
        return self.coder.parts(section, self.dtype, H, T, D, i)

    def unpack_parts(self, parts: dict[str, torch.Tensor], device: Device = None, dtype: torch.dtype | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys [H, T, D], values [H, T, D]) from `layer_parts` on `device` in `dtype` (default: the
        model's). Native on the host in the model's dtype: views, no copy."""
        return self.coder.unpack(parts, device, dtype or self.dtype)

    def unpack_layer(self, i: int, section: torch.Tensor, device: Device = None, dtype: torch.dtype | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """`layer_parts` then `unpack_parts`: layer i from its checked section on `device` in `dtype`."""
        return self.unpack_parts(self.layer_parts(i, section), device, dtype)


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
    ids = bytes(memoryview(data)[start:start + 8 * T])
    if verify_checksum and _header_digest(header, ids) != header["digest"]:
        raise CorruptEntryError("header checksum mismatch")
    token_ids = torch.frombuffer(bytearray(ids), dtype=torch.int64) if T else torch.empty(0, dtype=torch.int64)
    return EntryHead(header, start, token_ids, get_codec(header["codec"], header.get("tables")))


def writable(data: bytes | memoryview | bytearray) -> torch.Tensor:
    """`data` as a uint8 tensor: a view where the buffer is writable, else one copy (torch
    views only writable buffers)."""
    view = memoryview(data).cast("B")
    if view.readonly:
        view = memoryview(bytearray(view))
    return torch.frombuffer(view, dtype=torch.uint8) if len(view) else torch.empty(0, dtype=torch.uint8)


def decode_layer(head: EntryHead, i: int, section: Any, *, verify_checksum: bool = True,
                 device: Device = None, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys [H, T, D], values [H, T, D]) of layer `i` from its section's bytes, in the model's dtype
    (or `dtype`) on `device`. Raises CorruptEntryError if the bytes are not the layer the header describes."""
    if verify_checksum:
        head.check_layer(i, section)
    elif len(memoryview(section).cast("B")) != head.layer_range(i)[1]:
        raise CorruptEntryError(f"layer {i} is not {head.layer_range(i)[1]} bytes")
    return head.unpack_layer(i, writable(section), device, dtype)


def decode(data: bytes | memoryview, expected_fingerprint: str | None = None, *,
           verify_checksum: bool = True, device: Device = None) -> ChunkKV:
    """Deserialize and check a whole entry into the model's dtype (the dtype it was encoded from).

    `verify_checksum=False` skips only the digests (for bytes that never left this process).
    Raises CorruptEntryError for damaged data, KVMismatchError for another model's entry.
    """
    head = parse_head(data, expected_fingerprint, verify_checksum=verify_checksum)
    if len(data) != head.nbytes:
        raise CorruptEntryError(f"entry is {len(data)} bytes, its header implies {head.nbytes}")
    L, H, T, D = head.shape
    keys = torch.empty((L, H, T, D), dtype=head.dtype, device=device)  # [L, H, T, D]
    values = torch.empty((L, H, T, D), dtype=head.dtype, device=device)  # [L, H, T, D]
    on_host = _on_host(device)
    buffer = np.frombuffer(data, np.uint8) if on_host else writable(data)  # the host reads the bytes in place
    for i in range(L):
        offset, length = head.layer_range(i)
        section = buffer[offset:offset + length]
        if verify_checksum:
            head.check_layer(i, section if on_host else section.numpy())
        if on_host:
            head.coder.unpack_into(head.coder.host_parts(section, head.dtype, H, T, D, i), keys[i], values[i])
        else:
            keys[i], values[i] = head.unpack_layer(i, section, device)
    return ChunkKV(keys, values, head.token_ids, head.header["position"], head.header["context_hash"],
                   head.header["fingerprint"])
