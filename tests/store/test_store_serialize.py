"""Entry format: exact fp16, bounded int8, and no wrong tensor out of damaged bytes."""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from store import CODECS, CorruptEntryError, KVMismatchError, bytes_per_token, decode, encode, read_header
from store.serialize import HEAD_BYTES, MAGIC
from tests.helpers import assert_same_kv, random_kv


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_round_trip(codec, dtype):
    _, kv = random_kv(0, context=[1, 2, 3], dtype=dtype)
    assert_same_kv(decode(encode(kv, codec), "model-a"), kv, codec)


def test_int8_actually_quantizes_and_halves_the_size():
    _, kv = random_kv(1, shape=(2, 3, 64, 64))  # scales are small next to head_dim 64
    got = decode(encode(kv, "int8"))
    assert not torch.equal(got.keys, kv.keys)
    assert len(encode(kv, "int8")) < 0.6 * len(encode(kv, "fp16"))


def test_int8_key_scales_are_per_channel():
    # Channel 0 is 20x the others: a shared scale would blur the small channels by ~20x more.
    _, kv = random_kv(2)
    err = (decode(encode(kv, "int8")).keys - kv.keys).abs()[..., 1:]  # [L, H, T, D-1]
    assert err.max() <= kv.keys[..., 1:].abs().amax() / 127 / 2 * (1 + 1e-4)


@settings(max_examples=25, deadline=None)
@given(shape=st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 9), st.integers(1, 9)),
       magnitude=st.sampled_from([1e-4, 1.0, 300.0]), zero_token=st.booleans(), seed=st.integers(0, 2**16))
def test_int8_error_within_half_a_step(shape, magnitude, zero_token, seed):
    _, kv = random_kv(seed, shape=shape)
    kv.keys *= magnitude
    if zero_token:
        kv.values[:, :, 0] = 0  # an all-zero V slice must come back exactly zero
    got = decode(encode(kv, "int8"))
    assert_same_kv(got, kv, "int8")
    if zero_token:
        assert (got.values[:, :, 0] == 0).all()


def test_int8_refuses_non_finite():
    _, kv = random_kv(3)
    kv.values[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError):
        encode(kv, "int8")


def test_bytes_per_token():
    smollm = (30, 3, 512, 64)
    assert bytes_per_token("fp16", smollm) == 30 * 3 * 64 * 2 * 2 + 8  # K + V + the token id
    # int8 K + V, a float32 V scale per (layer, head), the token id, K scales shared by the chunk
    assert bytes_per_token("int8", smollm) == 30 * 3 * 64 * 2 + 30 * 3 * 4 + 8 + 45
    _, kv = random_kv(4)
    for codec in CODECS:
        header_bytes = len(encode(kv, codec)) - bytes_per_token(codec, (4, 3, 17, 8)) * 17
        assert 0 < header_bytes < 600


def test_decoded_tensors_are_the_callers_to_change():
    _, kv = random_kv(5)
    data = encode(kv)
    decode(data, verify_checksum=False).keys.zero_()
    assert_same_kv(decode(data), kv)


def test_wrong_fingerprint_raises_mismatch():
    _, kv = random_kv(6, fingerprint="model-b")
    with pytest.raises(KVMismatchError):
        decode(encode(kv), expected_fingerprint="model-a")


def _header_end(data: bytes) -> int:
    return 8 + int.from_bytes(data[4:8], "little")


@pytest.mark.parametrize("codec", CODECS)
def test_any_flipped_byte_is_caught(codec):
    _, kv = random_kv(7)
    data = encode(kv, codec)
    end = _header_end(data)
    for pos in (0, 5, 9, end // 2, end - 2, end, end + 100, len(data) // 2, len(data) - 1):
        bad = bytearray(data)
        bad[pos] ^= 0x01
        with pytest.raises((CorruptEntryError, KVMismatchError)):
            decode(bytes(bad), "model-a")


def test_truncated_or_extended_entries_are_caught():
    _, kv = random_kv(8)
    data = encode(kv)
    end = _header_end(data)
    for cut in (0, 3, 8, end - 1, end, end + 1, len(data) - 1):
        with pytest.raises(CorruptEntryError):
            decode(data[:cut])
    with pytest.raises(CorruptEntryError):
        decode(data + b"\0")


def _rewrite_header(data: bytes, **changes) -> bytes:
    end = _header_end(data)
    header = json.loads(data[8:end]) | changes
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return MAGIC + len(raw).to_bytes(4, "little") + raw + data[end:]


def test_header_fields_are_covered_by_the_checksum():
    _, kv = random_kv(9, context=[1, 2])
    data = encode(kv)
    with pytest.raises(CorruptEntryError, match="checksum"):
        decode(_rewrite_header(data, position=kv.position + 1))


@pytest.mark.parametrize("changes", [{"v": 2}, {"codec": "fp8"}, {"shape": [4, 3, 17]},
                                     {"shape": [4, 3, -17, 8]}, {"position": "0"}, {"sha256": None}])
def test_bad_headers_are_corrupt(changes):
    _, kv = random_kv(10)
    with pytest.raises(CorruptEntryError):
        decode(_rewrite_header(encode(kv), **changes))


def test_read_header_needs_only_the_head():
    _, kv = random_kv(11, context=[4])
    header = read_header(encode(kv, "int8")[:HEAD_BYTES])
    assert header["codec"] == "int8" and header["shape"] == [4, 3, 17, 8]
    assert (header["fingerprint"], header["position"]) == ("model-a", 1)
    with pytest.raises(CorruptEntryError):
        read_header(b"not a kv entry at all")
