"""KV codecs: how one layer's keys and values [H, T, D] become a section of an entry's bytes, and back.

A `Codec` turns keys/values [L, H, T, D] into one section of bytes per layer (`sections`), and a
section back into (keys, values) [H, T, D] in the model's dtype on the model's device in two stages,
so each runs where it is cheap:

- `parts(section)`: on the host (the store's read threads): the section's parts, as views of its
  bytes, or for an entropy-coded section its decoded symbols.
- `unpack(parts, device, dtype)`: the parts cross to the model's device as stored and are dequantised
  there with tensor ops. `unpack_into` is the host form for a whole-entry read (numpy, no intermediate).

Fixed-size codecs (a section's length follows from the shape; `layout` lists its parts):

- ``native``: keys and values [H, T, D] in the model's own dtype (bfloat16 stays bfloat16). Exact.
- ``fp16``: keys and values fp16 [H, T, D]. Exact for fp16 data; otherwise the value cast to fp16.
- ``int8``: k_scale f32 [H, 1, D], v_scale f32 [H, T, 1], keys int8 [H, T, D], values int8
  [H, T, D]. Symmetric: keys one scale per (layer, head, channel) over the tokens (K has outlier
  channels), values one per (layer, head, token). scale = amax / 127, q = round(x / scale), so
  |x - decoded| <= scale / 2 (up to the model dtype's rounding).
- ``int4``: KIVI (arXiv 2402.02750): asymmetric, keys per (head, channel) over groups of `KEY_GROUP`
  tokens, values per (head, token) over the head's channels; an fp16 scale and zero point per group,
  rounded outward (zero <= min, scale >= (max - zero) / 15) so nothing clips: |x - decoded| <= scale / 2
  (up to the model dtype's rounding). Two values a byte over the layer's [H, T, D] flattened: 4.5 bits a
  value at 64-token key groups and head_dim 64. (2 bits the same way lost too much: KL x6 at blend@0.15.)

Entropy-coded (a section's length depends on the data):

- ``cachegen``: CacheGen (arXiv 2310.07240): symmetric quantisation with one fp16 scale per (layer,
  token) for keys and one for values, bins per layer (`BinPlan`: more for the first layers),
  |x - decoded| <= scale / 2; the symbols ANS-coded (`constriction`) with one probability model per
  (layer, K/V, channel) fitted once per model (`CacheGenTables`) and named by its content hash in
  every entry's header, not stored in it. Decoding needs those tables (`register_tables`); an entry
  naming tables this process does not hold is unreadable here: a miss, recomputed and rewritten.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import struct
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from blend import cpu_kernels
from common.chunk_kv import ChunkKV
from common.placement import HOST

Section = tuple[str, torch.dtype, tuple[int, ...]]  # name, dtype, shape
Device = torch.device | str | None


class CorruptEntryError(ValueError):
    """Serialized KV bytes are damaged, truncated, of another format version, or not a KV at all."""


class OldFormatError(CorruptEntryError):
    """A ragblend entry this build cannot read though it is not damaged: another format version, or
    coded with probability tables this process does not hold."""


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


def _as_bytes(t: torch.Tensor) -> bytes:
    """A tensor's raw bytes (any dtype, bfloat16 included)."""
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def _fp16_at_least(x: torch.Tensor) -> torch.Tensor:
    """The smallest fp16 >= x (float32, finite): a scale or bound rounded outward, so nothing clips.
    Values past fp16's range come back inf (the caller refuses them)."""
    h = x.half()
    bits = h.view(torch.int16)
    up = torch.where(h >= 0, bits + 1, bits - 1).view(torch.float16)  # one ulp towards +inf
    return torch.where(h.float() < x, up, h)


def _finite_fp16(*tensors: torch.Tensor, codec: str) -> None:
    if not all(bool(torch.isfinite(t).all()) for t in tensors):
        raise ValueError(f"cannot {codec}-encode a KV holding inf or nan, or values past fp16's range")


# --- the codec interface --------------------------------------------------------------------------

class Codec:
    """One layer section's format. `pack` turns keys/values [L, H, T, D] into named parts (each [L, ...]),
    `sections` into one section of bytes per layer; `parts` reads a section's parts back on the host and
    `unpack` turns one layer's parts (host tensors) into (keys, values) [H, T, D] on `device` in `dtype`
    (the model's). Fixed-size codecs list their parts in `layout`; `fixed_size` False: a section's
    length depends on the data (the entry's header holds each one)."""

    name: str
    fixed_size = True
    layerwise = True  # a layer is coded alone (`round_trip_spans`): not cachegen's, its bins follow the layer's place

    def header_fields(self) -> dict[str, Any]:
        """What an entry's header must name for a reader to decode it, beyond the codec's name."""
        return {}

    def layout(self, dtype: torch.dtype, H: int, T: int, D: int) -> list[Section]:
        raise NotImplementedError

    def pack(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def error_bound(self, parts: dict[str, torch.Tensor], T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The stated bound on |x - decoded| for keys and values packed into `parts` (of T tokens),
        broadcastable to [L, H, T, D], before the model dtype's rounding: 0 for native, fp16's rounding (at most
        half an ulp), half a quantisation step for the others, from the scales they store."""
        zero = torch.zeros(())
        return zero, zero

    def sections(self, keys: torch.Tensor, values: torch.Tensor) -> list[bytes]:
        """Each layer's section, unpadded: its parts' bytes in `layout` order."""
        L, H, T, D = keys.shape
        packed = self.pack(keys, values)
        layout = self.layout(keys.dtype, H, T, D)
        return [b"".join(_as_bytes(packed[name][i].to(dt)) for name, dt, _ in layout) for i in range(L)]

    def parts(self, section: torch.Tensor, dtype: torch.dtype, H: int, T: int, D: int, layer: int
              ) -> dict[str, torch.Tensor]:
        """Layer `layer`'s parts from its `section` (a uint8 tensor [length]): views, no copy."""
        parts, at = {}, 0
        for name, part_dtype, shape in self.layout(dtype, H, T, D):
            n = math.prod(shape) * part_dtype.itemsize
            parts[name] = section[at:at + n].view(part_dtype).view(shape)
            at += n
        return parts

    def host_parts(self, section: np.ndarray, dtype: torch.dtype, H: int, T: int, D: int, layer: int
                   ) -> dict[str, np.ndarray]:
        """Layer `layer`'s parts from its `section` (a uint8 array, read-only is fine): views, bfloat16 as int16."""
        parts, at = {}, 0
        for name, part_dtype, shape in self.layout(dtype, H, T, D):
            n = math.prod(shape) * part_dtype.itemsize
            parts[name] = section[at:at + n].view(_NUMPY[part_dtype] or np.int16).reshape(shape)
            at += n
        return parts

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

    def round_trip_spans(self, keys: torch.Tensor, values: torch.Tensor, spans: Sequence[tuple[int, int]]) -> None:
        """Each span [start, end) of one layer's keys and values [1, H, N, D], in place, as `round_trip` gives
        that span's entry back (a codec with `layerwise`): what a prefill attends to for the spans the store will
        keep (blend.cache.StoredSpans)."""
        for start, end in spans:
            k, v = self.unpack(self.pack(keys[:, :, start:end], values[:, :, start:end]), keys.device, keys.dtype)
            keys[:, :, start:end], values[:, :, start:end] = k, v

    def round_trip(self, kv: ChunkKV) -> ChunkKV:
        """`kv` as a hit will read it back (fresh tensors, the model's dtype, kv's device): what a
        just-computed chunk must be so it gives the same answer as a stored one."""
        parts = self.pack(kv.keys, kv.values)
        keys, values = self.unpack(parts, kv.keys.device, kv.keys.dtype)
        if keys.data_ptr() == kv.keys.data_ptr():
            keys, values = keys.clone(), values.clone()
        return ChunkKV(keys, values, kv.token_ids, kv.position, kv.context_hash, kv.fingerprint)


def _dequantised(q: torch.Tensor, scale: torch.Tensor, device: Device, dtype: torch.dtype,
                 zero: torch.Tensor | None = None) -> torch.Tensor:
    """q * scale (+ zero) in float32 on `device`, then `dtype`: the parts cross as stored."""
    x = q.to(device, non_blocking=True).float() * scale.to(device, non_blocking=True).float()
    if zero is not None:
        x += zero.to(device, non_blocking=True).float()
    return x.to(dtype, memory_format=torch.contiguous_format)


# --- native, fp16, int8 ----------------------------------------------------------------------------

def quantize_int8(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one float32 scale per slice reduced over `dim` (kept as size 1)."""
    x = x.float()
    scale = x.abs().amax(dim=dim, keepdim=True) / 127
    if not torch.isfinite(scale).all():  # amax propagates inf/nan, so this checks every element
        raise ValueError("cannot int8-encode a KV holding inf or nan")
    scale = _nonzero(scale)
    q = torch.round(x / scale).clamp_(-127, 127).to(torch.int8)
    return q, scale


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero slice: any scale is exact


@functools.lru_cache(maxsize=64)  # a prefill asks for the same spans at every layer
def _span_bounds(spans: tuple[tuple[int, int], ...]) -> torch.Tensor:
    return torch.tensor(spans, dtype=torch.int64).view(-1, 2)                                      # [S, 2]


@functools.lru_cache(maxsize=64)
def _span_rows(spans: tuple[tuple[int, int], ...], device: Device) -> tuple[slice | torch.Tensor, torch.Tensor]:
    """The rows of `spans` (a slice where they lie one after another, as a prompt's new messages do: a view;
    else their positions, [n] int64) and the index of the span each row belongs to ([n] int64)."""
    lengths = torch.tensor([end - start for start, end in spans])
    owner = torch.repeat_interleave(torch.arange(len(spans)), lengths).to(device)
    if all(a[1] == b[0] for a, b in zip(spans, spans[1:])):
        return slice(spans[0][0], spans[-1][1]), owner
    return torch.cat([torch.arange(start, end) for start, end in spans]).to(device), owner


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

    def error_bound(self, parts, T):  # rounded to the nearest fp16: half an ulp (normal), or of a subnormal
        return tuple(parts[p].float().abs() * 2.0 ** -11 * (1 + 2.0 ** -10) + 2.0 ** -25 for p in ("keys", "values"))

    def round_trip_spans(self, keys, values, spans):
        """Elementwise: every span at once."""
        if spans:
            rows, _ = _span_rows(tuple(spans), keys.device)
            for out in (keys, values):
                out[0][:, rows] = out[0][:, rows].half().to(out.dtype)


class Int8Codec(Codec):
    name = "int8"

    def layout(self, dtype, H, T, D):  # the f32 scales first keep every part aligned
        return [("k_scale", torch.float32, (H, 1, D)), ("v_scale", torch.float32, (H, T, 1)),
                ("keys", torch.int8, (H, T, D)), ("values", torch.int8, (H, T, D))]

    def pack(self, keys, values):
        k_q, k_scale = quantize_int8(keys, dim=-2)  # keys: [L, H, T, D], k_scale: [L, H, 1, D]
        v_q, v_scale = quantize_int8(values, dim=-1)  # values: [L, H, T, D], v_scale: [L, H, T, 1]
        return {"keys": k_q, "values": v_q, "k_scale": k_scale, "v_scale": v_scale}

    def error_bound(self, parts, T):
        return parts["k_scale"].float() / 2, parts["v_scale"].float() / 2

    def round_trip_spans(self, keys, values, spans):
        """Every span at once, bit for bit as pack and unpack give each (a prefill rounds ~150 spans a layer): in
        one pass where this process loaded the CPU kernels (blend.cpu_kernels.int8_round_trip), else torch's ops."""
        if not spans:
            return
        if cpu_kernels.loaded() and _on_host(keys.device) and keys.dtype == values.dtype == torch.float32:
            cpu_kernels.int8_round_trip(keys, values, _span_bounds(tuple(spans)))
            return
        rows, owner = _span_rows(tuple(spans), keys.device)                                  # [n] each
        k, v = (x[0][:, rows].float() for x in (keys, values))      # each [H, n, D] (a view: a slice, float32)
        amax = k.new_zeros(k.shape[0], len(spans), k.shape[2]).scatter_reduce_(
            1, owner[None, :, None].expand_as(k), k.abs(), "amax")                            # [H, spans, D]
        k_scale = _nonzero(amax / 127).index_select(1, owner)                                 # [H, n, D]
        v_scale = _nonzero(v.abs().amax(dim=-1, keepdim=True) / 127)                          # [H, n, 1]
        for x, scale, out in ((k, k_scale, keys), (v, v_scale, values)):  # round(x / scale) * scale, in place
            out[0][:, rows] = x.div_(scale).round_().clamp_(-127, 127).mul_(scale)

    def unpack(self, parts, device, dtype):
        if _on_host(device):  # numpy, for host_to's reason
            def dequantised(q, scale):
                x = np.multiply(q.numpy(), scale.numpy(), dtype=np.float32)
                return host_to(torch.from_numpy(x), dtype)
            return dequantised(parts["keys"], parts["k_scale"]), dequantised(parts["values"], parts["v_scale"])
        # int8 + scales cross to the device; the multiply (in float32) happens there.
        return (_dequantised(parts["keys"], parts["k_scale"], device, dtype),
                _dequantised(parts["values"], parts["v_scale"], device, dtype))

    def unpack_into(self, parts, keys, values):
        for q, scale, out in ((parts["keys"], parts["k_scale"], keys), (parts["values"], parts["v_scale"], values)):
            if out.dtype == torch.float32:
                np.multiply(q, scale, out=out.numpy())
            else:
                _np_into(np.multiply(q, scale, dtype=np.float32), out)


# --- int4 (KIVI) --------------------------------------------------------------------------------------

KEY_GROUP = 64  # tokens a key scale spans: KIVI's 32-128; 64 keeps int4 at 0.28x fp16 with key error 0.047


def quantize_asymmetric(x: torch.Tensor, dim: int, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 in [0, levels], scale fp16, zero fp16), scale and zero per slice reduced over `dim` (kept
    as size 1) and rounded outward to fp16: zero <= min and zero + levels * scale >= max, so nothing clips
    and |x - (q * scale + zero)| <= scale / 2."""
    x = x.float()
    lo, hi = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    zero = -_fp16_at_least(-lo)  # the largest fp16 <= lo
    scale = _fp16_at_least((hi - zero.float()) / levels)
    _finite_fp16(zero, scale, codec=f"{levels + 1}-level")
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant slice: any scale is exact
    q = torch.round((x - zero.float()) / scale.float()).clamp_(0, levels).to(torch.uint8)
    return q, scale, zero


class Int4Codec(Codec):
    """4-bit KIVI (see the module's docstring): keys per (head, channel) over `key_group`-token groups,
    values per (head, token) over the channels."""

    name, bits, key_group = "int4", 4, KEY_GROUP
    levels, per_byte = (1 << bits) - 1, 8 // bits

    def layout(self, dtype, H, T, D):  # fp16 parts first keep every part aligned
        groups, packed = -(-T // self.key_group), -(-H * T * D // self.per_byte)
        return [("k_scale", torch.float16, (H, groups, D)), ("k_zero", torch.float16, (H, groups, D)),
                ("v_scale", torch.float16, (H, T, 1)), ("v_zero", torch.float16, (H, T, 1)),
                ("keys", torch.uint8, (packed,)), ("values", torch.uint8, (packed,))]

    def pack(self, keys, values):
        L, H, T, D = keys.shape
        G = self.key_group
        groups = -(-T // G)
        # Keys grouped along the tokens: pad the last group with its own last token (min and max unchanged).
        padded = torch.cat([keys, keys[:, :, -1:].expand(L, H, groups * G - T, D)], dim=2) if T else keys
        k_q, k_scale, k_zero = quantize_asymmetric(padded.view(L, H, groups, G, D), dim=3, levels=self.levels)
        k_q = k_q.view(L, H, groups * G, D)[:, :, :T]  # [L, H, T, D]
        v_q, v_scale, v_zero = quantize_asymmetric(values, dim=-1, levels=self.levels)  # v_scale: [L, H, T, 1]
        return {"keys": self._packed(k_q), "values": self._packed(v_q), "k_scale": k_scale.squeeze(3),
                "k_zero": k_zero.squeeze(3), "v_scale": v_scale, "v_zero": v_zero}

    def error_bound(self, parts, T):
        k_scale = parts["k_scale"].float().repeat_interleave(self.key_group, dim=-2)[..., :T, :]  # per token
        return k_scale / 2, parts["v_scale"].float() / 2

    def _packed(self, q: torch.Tensor) -> torch.Tensor:
        """q [L, H, T, D] (values < 2**bits) -> uint8 [L, ceil(H*T*D / per_byte)], the first value in the low bits."""
        flat = q.reshape(q.shape[0], -1)
        flat = torch.nn.functional.pad(flat, (0, -flat.shape[1] % self.per_byte))
        shifts = torch.arange(0, 8, self.bits, dtype=torch.uint8, device=q.device)  # [per_byte]
        return (flat.view(q.shape[0], -1, self.per_byte) << shifts).sum(-1, dtype=torch.uint8)

    def unpack(self, parts, device, dtype):
        """On `device`, one path for every device: the packed bytes and fp16 scales cross as stored."""
        *lead, H, T, _ = parts["v_scale"].shape
        D = parts["k_scale"].shape[-1]
        shifts = torch.arange(0, 8, self.bits, dtype=torch.uint8, device=device)  # [per_byte]

        def symbols(packed: torch.Tensor) -> torch.Tensor:  # [..., bytes] -> [..., H, T, D]
            q = (packed.to(device, non_blocking=True).unsqueeze(-1) >> shifts) & self.levels
            return q.flatten(-2)[..., :H * T * D].view(*lead, H, T, D)

        def per_token(group_part: torch.Tensor) -> torch.Tensor:  # [..., H, groups, D] -> [..., H, T, D]
            return group_part.to(device, non_blocking=True).repeat_interleave(self.key_group, dim=-2)[..., :T, :]

        keys = _dequantised(symbols(parts["keys"]), per_token(parts["k_scale"]), device, dtype,
                            per_token(parts["k_zero"]))
        values = _dequantised(symbols(parts["values"]), parts["v_scale"], device, dtype, parts["v_zero"])
        return keys, values

    def unpack_into(self, parts, keys, values):
        k, v = self.unpack({name: torch.from_numpy(part.copy()) for name, part in parts.items()}, "cpu", keys.dtype)
        keys.copy_(k)
        values.copy_(v)


# --- cachegen: quantised, then entropy-coded ----------------------------------------------------------

Bands = tuple[tuple[int, int], ...]  # (first layer, bins), ascending from layer 0


@dataclass(frozen=True)
class BinPlan:
    """CacheGen's quantisation bins per layer, for keys and values: bands of (first layer, bins).

    `bins` as in LMCache's cachegen: symbols -(bins/2 - 1) .. bins/2 - 1 (bins - 1 levels), so
    |x - decoded| <= amax / (bins/2 - 1) / 2 for a token's largest |x| in that layer.
    """

    keys: Bands
    values: Bands

    def __post_init__(self) -> None:
        for bands in (self.keys, self.values):
            firsts = [first for first, _ in bands]
            if not bands or firsts[0] != 0 or firsts != sorted(set(firsts)):
                raise ValueError(f"bin bands {bands} must start at layer 0 and ascend")
            if any(not 4 <= bins <= 256 for _, bins in bands):
                raise ValueError(f"bins {[b for _, b in bands]} must lie in [4, 256]")

    @classmethod
    def of(cls, plan: BinPlan | dict[str, Sequence[Sequence[int]]]) -> BinPlan:
        """A plan from its dict form ({"keys": [[first layer, bins], ...], "values": [...]}) or itself."""
        if isinstance(plan, BinPlan):
            return plan
        return cls(*(tuple((int(first), int(bins)) for first, bins in plan[part]) for part in ("keys", "values")))

    def as_dict(self) -> dict[str, list[list[int]]]:
        return {"keys": [list(b) for b in self.keys], "values": [list(b) for b in self.values]}

    def per_layer(self, num_layers: int) -> np.ndarray:
        """bins [L, 2]: layer l's keys (0) and values (1)."""
        def expand(bands: Bands) -> list[int]:
            return [next(bins for first, bins in reversed(bands) if first <= layer) for layer in range(num_layers)]
        return np.array([expand(self.keys), expand(self.values)], dtype=np.int64).T.reshape(num_layers, 2)


# Chosen by measurement on SmolLM2 (BENCHMARKS.md, "Compressed KV"; configs/default.yaml says why): 64 key bins
# keep blend@0.15's KL within 10% of exact KV; 32 then 16 (CacheGen's own split) doubled it.
DEFAULT_BINS = BinPlan(keys=((0, 64),), values=((0, 16),))


def quantize_per_token(x: torch.Tensor, bins: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CacheGen's quantiser: x [L, H, T, D], bins [L] -> (q int8 [L, H, T, D] in [-m, m] for m = bins/2 - 1
    of its layer, scale fp16 [L, 1, T, 1]): one scale per (layer, token) over heads and channels,
    rounded up to fp16 so nothing clips; |x - q * scale| <= scale / 2."""
    x = x.float()
    top = (bins // 2 - 1).to(x.device, torch.float32).view(-1, 1, 1, 1)  # [L, 1, 1, 1]
    scale = _fp16_at_least(x.abs().amax(dim=(1, 3), keepdim=True) / top)  # [L, 1, T, 1]
    _finite_fp16(scale, codec="cachegen")
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero token: any scale is exact
    q = torch.round(x / scale.float()).clamp_(-top, top).to(torch.int8)
    return q, scale


TABLES_FORMAT = "ragblend-cachegen-tables"
TABLES_VERSION = 1


class CacheGenTables:
    """The probability model of the `cachegen` codec for one model: symbol counts per (layer, K/V,
    channel), fitted once from sample chunks, shared by every entry it coded (named by `id`, a sha256
    of its content) and kept beside the store, never inside an entry. Serialised as safetensors
    (`to_bytes`; no pickle)."""

    def __init__(self, fingerprint: str, plan: BinPlan, counts: np.ndarray) -> None:
        """counts: int32 [L, 2, C, A]: how often channel c (head * D + d) of layer l's keys (0) or values
        (1) took symbol s (0 .. bins - 2, bins of that layer; 0 past it), plus one (every symbol codable)."""
        self.fingerprint, self.plan = fingerprint, plan
        self.counts = np.ascontiguousarray(counts, dtype=np.int32)
        L, two, _, A = self.counts.shape
        self.bins = plan.per_layer(L)  # [L, 2]
        if two != 2 or A != int(self.bins.max()) - 1 or (self.counts < 0).any():
            raise ValueError(f"counts {self.counts.shape} do not fit bins {plan}")
        digest = hashlib.sha256(json.dumps([TABLES_FORMAT, TABLES_VERSION, fingerprint, plan.as_dict(),
                                            list(self.counts.shape)]).encode())
        digest.update(self.counts.tobytes())
        self.id = digest.hexdigest()
        self._models: dict[tuple[int, int], list] = {}
        self._lock = threading.Lock()

    @property
    def num_layers(self) -> int:
        return self.counts.shape[0]

    @property
    def channels(self) -> int:
        return self.counts.shape[2]

    @classmethod
    def fit(cls, samples: Iterable[ChunkKV], plan: BinPlan) -> CacheGenTables:
        """Count the symbols of `samples` (chunks of one model) quantised by `plan`: deterministic, so
        replicas fitting the same samples of the same model agree on the tables and their id."""
        counts, fingerprint = None, None
        for kv in samples:
            L, H, T, D = kv.keys.shape
            bins = torch.from_numpy(plan.per_layer(L))
            if counts is None:
                counts, fingerprint = np.ones((L, 2, H * D, int(bins.max()) - 1), np.int64), kv.fingerprint
            elif kv.fingerprint != fingerprint or counts.shape[:3] != (L, 2, H * D):
                raise ValueError("samples of one model and one shape, please")
            for part, x in enumerate((kv.keys, kv.values)):
                q, _ = quantize_per_token(x, bins[:, part])
                symbols = _coder_symbols(_channel_major(q).numpy(), bins[:, part].numpy())  # [L, C, T]
                A = counts.shape[-1]
                for layer in range(L):
                    flat = (np.arange(H * D)[:, None] * A + symbols[layer]).ravel()
                    counts[layer, part] += np.bincount(flat, minlength=H * D * A).reshape(H * D, A)
        if counts is None:
            raise ValueError("no samples to fit the cachegen tables on")
        alphabet = plan.per_layer(counts.shape[0]) - 1  # [L, 2]
        past = np.arange(counts.shape[-1]) >= alphabet[..., None, None]  # [L, 2, 1, A]: past a layer's bins
        counts *= ~past
        return cls(fingerprint, plan, counts.astype(np.int32))

    def models(self, layer: int, part: int) -> list:
        """The C categorical models of (layer, keys 0 / values 1), built on first use."""
        key = (layer, part)
        if key not in self._models:
            import constriction

            n = int(self.bins[layer, part]) - 1
            built = [constriction.stream.model.Categorical(c[:n].astype(np.float64), perfect=False)
                     for c in self.counts[layer, part]]
            with self._lock:
                self._models.setdefault(key, built)
        return self._models[key]

    def to_bytes(self) -> bytes:
        from safetensors.numpy import save

        return save({"counts": self.counts}, metadata={
            "format": TABLES_FORMAT, "version": str(TABLES_VERSION), "fingerprint": self.fingerprint,
            "plan": json.dumps(self.plan.as_dict()), "id": self.id})

    @classmethod
    def from_bytes(cls, data: bytes) -> CacheGenTables:
        """Tables from `to_bytes`' output; ValueError unless they are whole and of this version."""
        from safetensors.numpy import load

        try:
            counts = load(data)["counts"]
            (header_len,) = struct.unpack_from("<Q", data)  # safetensors: u64 header length, JSON header
            meta = json.loads(data[8:8 + header_len]).get("__metadata__") or {}
            if meta.get("format") != TABLES_FORMAT or meta.get("version") != str(TABLES_VERSION):
                raise ValueError(f"{meta.get('format')} version {meta.get('version')}")
            tables = cls(meta["fingerprint"], BinPlan.of(json.loads(meta["plan"])), counts)
        except Exception as exc:  # safetensors raises its own error types for damaged bytes
            raise ValueError(f"not cachegen tables of version {TABLES_VERSION}: {exc}") from None
        if tables.id != meta.get("id"):
            raise ValueError("cachegen tables do not match their id: damaged")
        return tables


def _channel_major(q: torch.Tensor) -> torch.Tensor:
    """[..., H, T, D] -> [..., H, D, T] contiguous: a channel's tokens in a row, so each channel is coded
    with its own model in one call (the layout cachegen's symbols keep until the device dequantises them)."""
    return q.transpose(-1, -2).contiguous().cpu()


def _coder_symbols(q: np.ndarray, bins: np.ndarray) -> np.ndarray:
    """Centred symbols q int8 [L, H, D, T] -> the coder's int32 [L, H*D, T] in [0, bins - 2] of each layer."""
    L, H, D, T = q.shape
    return (q.astype(np.int32) + (bins // 2 - 1).reshape(L, 1, 1, 1).astype(np.int32)).reshape(L, H * D, T)


class CacheGenCodec(Codec):
    """Quantised by a `BinPlan`, ANS-coded with `CacheGenTables`. Without tables it only quantises
    (`round_trip`, `pack`, `unpack`: what quality depends on; the coding is lossless); coding needs them.

    A section: u32 word count, u32 0, k_scale fp16 [T], v_scale fp16 [T], the ANS words (u32): keys
    then values of the layer, channel by channel. Symbols travel channel-major ([H, D, T], as coded) and
    the device's multiply turns them to [H, T, D].
    """

    name = "cachegen"
    fixed_size, layerwise = False, False
    _PREFIX = struct.Struct("<II")

    def __init__(self, plan: BinPlan = DEFAULT_BINS, tables: CacheGenTables | None = None) -> None:
        if tables is not None and tables.plan != plan:
            raise ValueError(f"tables fitted for bins {tables.plan}, not {plan}")
        self.plan, self.tables = plan, tables

    def header_fields(self):
        return {"tables": self._tables().id}

    def _tables(self) -> CacheGenTables:
        if self.tables is None:
            raise ValueError("the cachegen codec codes with fitted tables: CacheGenTables.fit, then register_tables")
        return self.tables

    def pack(self, keys, values):
        bins = torch.from_numpy(self.plan.per_layer(keys.shape[0]))
        k_q, k_scale = quantize_per_token(keys, bins[:, 0])  # [L, H, T, D], [L, 1, T, 1]
        v_q, v_scale = quantize_per_token(values, bins[:, 1])
        return {"keys": _channel_major(k_q), "values": _channel_major(v_q), "k_scale": k_scale,  # [L, H, D, T]
                "v_scale": v_scale}

    def error_bound(self, parts, T):
        return parts["k_scale"].float() / 2, parts["v_scale"].float() / 2

    def sections(self, keys, values):
        tables = self._tables()
        L, H, T, D = keys.shape
        if (tables.num_layers, tables.channels) != (L, H * D):
            raise ValueError(f"cachegen tables for {tables.num_layers} layers x {tables.channels} channels "
                             f"cannot code KV of shape {tuple(keys.shape)}")
        packed = self.pack(keys, values)
        symbols = [_coder_symbols(packed[part].numpy(), tables.bins[:, i])
                   for i, part in enumerate(("keys", "values"))]  # [L, C, T] each
        return [self._section(tables, layer, [s[layer] for s in symbols],
                              _as_bytes(packed["k_scale"][layer]) + _as_bytes(packed["v_scale"][layer]))
                for layer in range(L)]

    def _section(self, tables: CacheGenTables, layer: int, symbols: list[np.ndarray], scales: bytes) -> bytes:
        import constriction

        coder = constriction.stream.stack.AnsCoder()
        for part in (1, 0):  # a stack: what is decoded last is encoded first
            models = tables.models(layer, part)
            for c in reversed(range(len(models))):
                coder.encode_reverse(symbols[part][c], models[c])
        words = coder.get_compressed()
        return self._PREFIX.pack(len(words), 0) + scales + words.astype("<u4").tobytes()

    def parts(self, section, dtype, H, T, D, layer):
        return {name: torch.from_numpy(part)
                for name, part in self.host_parts(section.numpy(), dtype, H, T, D, layer).items()}

    def host_parts(self, section, dtype, H, T, D, layer):
        """Entropy-decode layer `layer`: symbols int8 [H, D, T] and scales fp16 [1, T, 1] of keys and values.
        Raises CorruptEntryError for a stream that is not what its section says (even unchecked by digest)."""
        import constriction

        tables = self._tables()
        head = self._PREFIX.size + 4 * T
        if len(section) < head:
            raise CorruptEntryError(f"cachegen section of {len(section)} bytes is shorter than its scales")
        words, _ = self._PREFIX.unpack_from(section)
        if -(-(head + 4 * words) // 8) * 8 != len(section):
            raise CorruptEntryError(f"cachegen section of {len(section)} bytes does not hold {words} words")
        scales = section[self._PREFIX.size:head].view(np.float16).reshape(2, 1, T, 1)
        coder = constriction.stream.stack.AnsCoder(section[head:head + 4 * words].view("<u4").astype(np.uint32))
        decoded = np.empty((2, H * D, T), np.int32)  # keys, values: channel-major, as coded
        try:
            for part in (0, 1):
                for c, model in enumerate(tables.models(layer, part)):
                    decoded[part, c] = coder.decode(model, T)
        except Exception as exc:  # constriction's own error for a stream that runs out or is invalid
            raise CorruptEntryError(f"cachegen stream of layer {layer} does not decode: {exc}") from None
        if not coder.is_empty():
            raise CorruptEntryError(f"cachegen stream of layer {layer} has words left over")
        symbols = (decoded - (tables.bins[layer] // 2 - 1).reshape(2, 1, 1)).astype(np.int8)  # centred
        return {"keys": symbols[0].reshape(H, D, T), "values": symbols[1].reshape(H, D, T),
                "k_scale": scales[0], "v_scale": scales[1]}

    def unpack(self, parts, device, dtype):
        """On `device`, one path for every device: int8 symbols [..., H, D, T] and fp16 scales cross, then
        q * scale, [..., H, T, D]."""
        return (_dequantised(parts["keys"].transpose(-1, -2), parts["k_scale"], device, dtype),
                _dequantised(parts["values"].transpose(-1, -2), parts["v_scale"], device, dtype))

    def unpack_into(self, parts, keys, values):
        for q, scale, out in ((parts["keys"], parts["k_scale"], keys), (parts["values"], parts["v_scale"], values)):
            if out.dtype == torch.float32:  # in float32: the scales are fp16
                np.multiply(q.swapaxes(-1, -2), scale, out=out.numpy(), dtype=np.float32)
            else:
                _np_into(np.multiply(q.swapaxes(-1, -2), scale, dtype=np.float32), out)


# --- names --------------------------------------------------------------------------------------------

CODEC_OBJECTS: dict[str, Codec] = {c.name: c for c in (NativeCodec(), Fp16Codec(), Int8Codec(), Int4Codec())}
CODECS = tuple(CODEC_OBJECTS)  # the codecs any KV can be stored with by name
CODEC_NAMES = (*CODECS, CacheGenCodec.name)  # ... and the one that needs fitted tables

_registered: dict[str, CacheGenCodec] = {}  # tables id -> the codec coding with them
_registered_lock = threading.Lock()


def register_tables(tables: CacheGenTables) -> CacheGenCodec:
    """The cachegen codec coding with `tables`; from now on entries naming them decode in this process."""
    with _registered_lock:
        return _registered.setdefault(tables.id, CacheGenCodec(tables.plan, tables))


def get_codec(name: str | Codec, tables: str | None = None, *, bins: BinPlan | dict | None = None) -> Codec:
    """The codec called `name` (a Codec: itself); for "cachegen", the one registered with tables `tables`
    (an id), or without one, the quantiser alone with `bins` (default DEFAULT_BINS): round trips, no coding."""
    if isinstance(name, Codec):
        return name
    if name == CacheGenCodec.name:
        if tables is None:
            return CacheGenCodec(BinPlan.of(bins or DEFAULT_BINS))
        with _registered_lock:
            codec = _registered.get(tables)
        if codec is None:
            raise OldFormatError(f"cachegen tables {tables[:16]} are not known to this process")
        return codec
    try:
        return CODEC_OBJECTS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; expected one of {CODEC_NAMES}") from None
