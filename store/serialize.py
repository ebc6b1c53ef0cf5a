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

A `Codec` is one layer section's layout, how a ChunkKV is packed into it and how a section is
unpacked into the model's dtype on the model's device:

- ``native``: keys and values [H, T, D] in the model's own dtype (bfloat16 stays bfloat16). Exact.
- ``fp16``: keys and values fp16 [H, T, D]. Exact for fp16 data; otherwise the value cast to fp16.
- ``int8``: k_scale f32 [H, 1, D], v_scale f32 [H, T, 1], keys int8 [H, T, D], values int8
  [H, T, D]. Symmetric: keys one scale per (layer, head, channel) over the tokens (K has outlier
  channels), values one per (layer, head, token). scale = amax / 127, q = round(x / scale), so
  |x - decoded| <= scale / 2 (up to the model dtype's rounding). Travels as int8 + scales and is
  dequantised on the model's device after the copy.

`decode` (whole entry) and `parse_head` + `decode_layer` check magic, version, header schema,
lengths, digests and (optionally) the fingerprint and raise `CorruptEntryError` /
`KVMismatchError`: they never return a wrong tensor. Entries of another format version raise
`OldFormatError`, a CorruptEntryError the store drops quietly (and the chunk is recomputed).
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
from common.placement import HOST

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
Section = tuple[str, torch.dtype, tuple[int, ...]]  # name, dtype, shape
Device = torch.device | str | None


class CorruptEntryError(ValueError):
    """Serialized KV bytes are damaged, truncated, of another format version, or not a KV at all."""


class OldFormatError(CorruptEntryError):
    """A ragblend entry of another format version: not damaged, just unreadable by this build."""


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def digest(data: Any) -> str:
    """xxh3-128 of a buffer (bytes, memoryview, a contiguous numpy array), hex."""
    return xxhash.xxh3_128_hexdigest(data)


# --- host copies ------------------------------------------------------------------------------

_NUMPY = {torch.float32: np.float32, torch.float16: np.float16, torch.int8: np.int8, torch.uint8: np.uint8,
          torch.bfloat16: None}  # bfloat16: moved as raw 16-bit words, converted by torch


def _on_host(device: Device) -> bool:
    """Whether tensors bound for `device` stay in host memory (None: where they are read, the host), so
    numpy can convert them (host_to's reason). The store asks where, never which kind of device."""
    return device is None or torch.device(device) == HOST.device


def host_to(t: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """A host tensor in `dtype`: `t` itself when it already is (and no `out`), else a copy (into `out`).

    Copies and conversions run in numpy where it has the dtypes: single-threaded and GIL-free. torch's
    intra-op pool stalls on a busy machine (measured at load 8 on 2 cores: 40 ms against 0.3 ms for a
    200 KB fp16 -> float32 layer), and the store's reads run beside the model.
    """
    if out is None and t.dtype == dtype:
        return t
    same = t.dtype == dtype
    if (same or (_NUMPY.get(t.dtype) is not None and _NUMPY.get(dtype) is not None)) and t.dtype in _NUMPY:
        if out is None:
            out = torch.empty(t.shape, dtype=dtype)
        if same and _NUMPY[dtype] is None:  # bfloat16 -> bfloat16: the raw words
            np.copyto(out.view(torch.int16).numpy(), t.view(torch.int16).numpy())
        else:
            np.copyto(out.numpy(), t.numpy(), casting="unsafe")
        return out
    return t.to(dtype) if out is None else out.copy_(t)


def _np_into(src: np.ndarray, out: torch.Tensor) -> None:
    """Copy (converting) a numpy array into a host tensor; a bfloat16 source comes as its int16 words."""
    if out.dtype == torch.bfloat16:
        if src.dtype == np.int16:  # bfloat16 -> bfloat16
            np.copyto(out.view(torch.int16).numpy(), src)
        else:
            out.copy_(torch.from_numpy(np.asarray(src, np.float32)))
    else:
        np.copyto(out.numpy(), src, casting="unsafe")


def _numpy_parts(codec: Codec, dtype: torch.dtype, section: np.ndarray, H: int, T: int, D: int
                 ) -> dict[str, np.ndarray]:
    """Views of one layer's parts over `section` (a uint8 array, read-only is fine), bfloat16 as int16."""
    parts, at = {}, 0
    for name, part_dtype, shape in codec.layout(dtype, H, T, D):
        n = math.prod(shape) * part_dtype.itemsize
        parts[name] = section[at:at + n].view(_NUMPY[part_dtype] or np.int16).reshape(shape)
        at += n
    return parts


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


class Codec:
    """One layer section's format. `layout` lists its parts in order, `pack` turns keys/values
    [L, H, T, D] into those parts (each [L, ...]), `unpack` turns one layer's parts (host tensors)
    into (keys, values) [H, T, D] on `device` in `dtype` (the model's)."""

    name: str

    def layout(self, dtype: torch.dtype, H: int, T: int, D: int) -> list[Section]:
        raise NotImplementedError

    def pack(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def unpack(self, parts: dict[str, torch.Tensor], device: Device, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if _on_host(device):
            return host_to(parts["keys"], dtype), host_to(parts["values"], dtype)
        # Copy as stored (non-blocking from pinned memory), then convert on the device.
        k = parts["keys"].to(device, non_blocking=True).to(dtype)
        v = parts["values"].to(device, non_blocking=True).to(dtype)
        return k, v

    def unpack_into(self, parts: dict[str, np.ndarray], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Decode one layer's parts (numpy views over the entry's bytes, bfloat16 as int16) into host
        tensors `keys`, `values` [H, T, D] in the model's dtype: one numpy pass each, no intermediate."""
        _np_into(parts["keys"], keys)
        _np_into(parts["values"], values)

    def round_trip(self, kv: ChunkKV) -> ChunkKV:
        """`kv` as a hit will read it back (fresh tensors, the model's dtype, kv's device): what a
        just-computed chunk must be so it gives the same answer as a stored one."""
        parts = self.pack(kv.keys, kv.values)
        keys, values = self.unpack(parts, kv.keys.device, kv.keys.dtype)
        if keys.data_ptr() == kv.keys.data_ptr():
            keys, values = keys.clone(), values.clone()
        return ChunkKV(keys, values, kv.token_ids, kv.position, kv.context_hash, kv.fingerprint)


class NativeCodec(Codec):
    name = "native"

    def layout(self, dtype, H, T, D):
        return [("keys", dtype, (H, T, D)), ("values", dtype, (H, T, D))]

    def pack(self, keys, values):
        return {"keys": keys, "values": values}


class Fp16Codec(Codec):
    name = "fp16"

    def layout(self, dtype, H, T, D):
        return [("keys", torch.float16, (H, T, D)), ("values", torch.float16, (H, T, D))]

    def pack(self, keys, values):
        return {"keys": keys.half(), "values": values.half()}


class Int8Codec(Codec):
    name = "int8"

    def layout(self, dtype, H, T, D):  # the f32 scales first keep every part aligned
        return [("k_scale", torch.float32, (H, 1, D)), ("v_scale", torch.float32, (H, T, 1)),
                ("keys", torch.int8, (H, T, D)), ("values", torch.int8, (H, T, D))]

    def pack(self, keys, values):
        k_q, k_scale = quantize_int8(keys, dim=-2)  # keys: [L, H, T, D], k_scale: [L, H, 1, D]
        v_q, v_scale = quantize_int8(values, dim=-1)  # values: [L, H, T, D], v_scale: [L, H, T, 1]
        return {"keys": k_q, "values": v_q, "k_scale": k_scale, "v_scale": v_scale}

    def unpack(self, parts, device, dtype):
        if _on_host(device):  # numpy, for host_to's reason
            def dequantised(q, scale):
                x = np.multiply(q.numpy(), scale.numpy(), dtype=np.float32)
                return host_to(torch.from_numpy(x), dtype)
            return dequantised(parts["keys"], parts["k_scale"]), dequantised(parts["values"], parts["v_scale"])
        # int8 + scales cross to the device; the multiply (in float32) happens there.
        on = {name: t.to(device, non_blocking=True) for name, t in parts.items()}
        return (on["keys"] * on["k_scale"]).to(dtype), (on["values"] * on["v_scale"]).to(dtype)

    def unpack_into(self, parts, keys, values):
        for q, scale, out in ((parts["keys"], parts["k_scale"], keys), (parts["values"], parts["v_scale"], values)):
            if out.dtype == torch.float32:
                np.multiply(q, scale, out=out.numpy())
            else:
                _np_into(np.multiply(q, scale, dtype=np.float32), out)


CODEC_OBJECTS: dict[str, Codec] = {c.name: c for c in (NativeCodec(), Fp16Codec(), Int8Codec())}
CODECS = tuple(CODEC_OBJECTS)


def get_codec(name: str) -> Codec:
    try:
        return CODEC_OBJECTS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; expected one of {CODECS}") from None


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"cannot store KV of dtype {dtype}; expected one of {sorted(DTYPES)}")
    return name


def layer_nbytes(codec: str, shape: Shape, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of one layer's section, padding included."""
    _, H, T, D = shape
    parts = get_codec(codec).layout(dtype, H, T, D)
    return _align(sum(math.prod(s) * dt.itemsize for _, dt, s in parts))


def _layer_offsets(codec: str, shape: Shape, dtype: torch.dtype) -> list[tuple[int, int]]:
    """(offset from the payload start, length) of each layer; the token ids (int64) come first."""
    first, size = 8 * shape[2], layer_nbytes(codec, shape, dtype)
    return [(first + i * size, size) for i in range(shape[0])]


def payload_nbytes(codec: str, shape: Shape, dtype: torch.dtype = torch.float32) -> int:
    return 8 * shape[2] + shape[0] * layer_nbytes(codec, shape, dtype)


def bytes_per_token(codec: str, shape: Shape, dtype: torch.dtype = torch.float32) -> int:
    """Payload bytes per token (rounded up) of a chunk of `shape` in `dtype`, per-chunk scales included."""
    return math.ceil(payload_nbytes(codec, shape, dtype) / max(shape[2], 1))


def section_parts(codec: Codec, dtype: torch.dtype, section: torch.Tensor, H: int, T: int, D: int
                  ) -> dict[str, torch.Tensor]:
    """Views of one layer's parts over `section` (a uint8 tensor [length]), no copy."""
    parts, at = {}, 0
    for name, part_dtype, shape in codec.layout(dtype, H, T, D):
        n = math.prod(shape) * part_dtype.itemsize
        parts[name] = section[at:at + n].view(part_dtype).view(shape)
        at += n
    return parts


# --- format -----------------------------------------------------------------------------------

def _canonical(header: dict[str, Any]) -> bytes:
    return json.dumps(header, sort_keys=True, separators=(",", ":")).encode()


def _header_digest(header: dict[str, Any], token_ids: Any) -> str:
    """xxh3-128 over the header without its digest field, then the token ids."""
    h = xxhash.xxh3_128(_canonical({k: v for k, v in header.items() if k != "digest"}))
    h.update(token_ids)
    return h.hexdigest()


def _as_bytes(t: torch.Tensor) -> bytes:
    """A host tensor's raw bytes (any dtype, bfloat16 included)."""
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def encode(kv: ChunkKV, codec: str = "fp16") -> bytes:
    """Serialize `kv` with `codec` ("native", "fp16" or "int8")."""
    c = get_codec(codec)
    shape = tuple(kv.keys.shape)
    L, H, T, D = shape
    dtype_name = _dtype_name(kv.keys.dtype)
    packed = c.pack(kv.keys, kv.values)
    layout = c.layout(kv.keys.dtype, H, T, D)
    size = layer_nbytes(codec, shape, kv.keys.dtype)
    token_ids = _as_bytes(kv.token_ids.to(torch.int64))
    sections = []
    for i in range(L):
        raw = b"".join(_as_bytes(packed[name][i].to(dt)) for name, dt, _ in layout)
        sections.append(raw + bytes(size - len(raw)))
    header = {"v": VERSION, "codec": codec, "dtype": dtype_name,
              "shape": list(shape), "fingerprint": kv.fingerprint, "context_hash": kv.context_hash,
              "position": int(kv.position), "token_hash": hash_ids(kv.token_ids),
              "layers": [[off, n, digest(s)] for (off, n), s in
                         zip(_layer_offsets(codec, shape, kv.keys.dtype), sections)]}
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
    if (len(shape) != 4 or not all(type(n) is int and n >= 0 for n in shape) or header["codec"] not in CODECS
            or header["dtype"] not in DTYPES):
        raise CorruptEntryError(f"bad shape {shape}, codec {header['codec']!r} or dtype {header['dtype']!r}")
    layers = header["layers"]
    expected = _layer_offsets(header["codec"], tuple(shape), DTYPES[header["dtype"]])
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
        return self.payload_start + payload_nbytes(self.codec, self.shape, self.dtype)

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
            raise CorruptEntryError(f"layer {i} is {len(memoryview(section).cast('B'))} bytes, the header says {length}")
        if digest(section) != self.header["layers"][i][2]:
            raise CorruptEntryError(f"layer {i} checksum mismatch")

    def unpack_layer(self, section: torch.Tensor, device: Device = None, dtype: torch.dtype | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys [H, T, D], values [H, T, D]) from a checked section (uint8 tensor) on `device` in
        `dtype` (default: the model's). Native on the host in the model's dtype: views, no copy."""
        _, H, T, D = self.shape
        codec = CODEC_OBJECTS[self.codec]
        return codec.unpack(section_parts(codec, self.dtype, section, H, T, D), device, dtype or self.dtype)


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
    return EntryHead(header, start, token_ids)


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
    return head.unpack_layer(writable(section), device, dtype)


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
    codec = CODEC_OBJECTS[head.codec]
    for i in range(L):
        offset, length = head.layer_range(i)
        section = buffer[offset:offset + length]
        if verify_checksum:
            head.check_layer(i, section if on_host else section.numpy())
        if on_host:
            codec.unpack_into(_numpy_parts(codec, head.dtype, section, H, T, D), keys[i], values[i])
        else:
            keys[i], values[i] = head.unpack_layer(section, device)
    return ChunkKV(keys, values, head.token_ids, head.header["position"], head.header["context_hash"],
                   head.header["fingerprint"])
