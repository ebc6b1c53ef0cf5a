"""Entry format: exact fp16, bounded int8, layers readable alone, and no wrong tensor out of damaged bytes."""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from store import (
    CODECS,
    CorruptEntryError,
    KVMismatchError,
    OldFormatError,
    bytes_per_token,
    decode,
    encode,
    read_header,
)
from store.serialize import HEAD_BYTES, MAGIC, decode_layer, head_nbytes, parse_head
from tests.helpers import assert_same_kv, random_kv


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
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
        assert 0 < header_bytes < 400 + 4 * 100  # fixed fields + one (offset, length, sha256) per layer


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
def test_every_flipped_byte_is_caught(codec):
    # Odd sizes, so the header and every layer section carry padding: that is checked too.
    _, kv = random_kv(7, shape=(3, 1, 3, 3))
    data = encode(kv, codec)
    for pos in range(len(data)):
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


@pytest.mark.parametrize("changes", [{"v": "2"}, {"codec": "fp8"}, {"shape": [4, 3, 17]},
                                     {"shape": [4, 3, -17, 8]}, {"position": "0"}, {"sha256": None},
                                     {"layers": []}, {"layers": [[0, 1, "x"]] * 4}, {"shape": [5, 3, 17, 8]}])
def test_bad_headers_are_corrupt(changes):
    _, kv = random_kv(10)
    with pytest.raises(CorruptEntryError) as caught:
        decode(_rewrite_header(encode(kv), **changes))
    assert not isinstance(caught.value, OldFormatError)


@pytest.mark.parametrize("version", [1, 2, 4])
def test_other_format_versions_are_old_format(version):
    # An entry of another format version (1 and 2 are what earlier builds wrote): a miss, never misread.
    _, kv = random_kv(12)
    header = {"v": version, "codec": "fp16", "dtype": "float32", "shape": [4, 3, 17, 8],
              "fingerprint": "model-a", "context_hash": kv.context_hash, "position": 0, "token_hash": "",
              "sha256": ""}
    raw = json.dumps(header).encode()
    entry = MAGIC + len(raw).to_bytes(4, "little") + raw + kv.token_ids.numpy().tobytes() + bytes(kv.nbytes // 2)
    with pytest.raises(OldFormatError, match=f"version {version}"):
        decode(entry)
    with pytest.raises(OldFormatError):
        parse_head(entry)


def test_read_header_needs_only_the_head():
    _, kv = random_kv(11, context=[4])
    header = read_header(encode(kv, "int8")[:HEAD_BYTES])
    assert header["codec"] == "int8" and header["shape"] == [4, 3, 17, 8]
    assert (header["fingerprint"], header["position"]) == ("model-a", 1)
    with pytest.raises(CorruptEntryError):
        read_header(b"not a kv entry at all")


# --- one layer at a time ------------------------------------------------------------------------

@pytest.mark.parametrize("codec", CODECS)
def test_every_layer_decodes_alone_exactly_as_the_whole_entry(codec):
    _, kv = random_kv(13, shape=(9, 2, 11, 8), context=[5])
    data = encode(kv, codec)
    whole = decode(data)
    head = parse_head(data[:head_nbytes(data)], "model-a")
    assert head.shape == (9, 2, 11, 8) and head.codec == codec and torch.equal(head.token_ids, kv.token_ids)
    assert head.nbytes == len(data)
    for i in reversed(range(9)):  # any order
        offset, length = head.layer_range(i)
        keys, values = decode_layer(head, i, data[offset:offset + length])
        assert keys.shape == values.shape == (2, 11, 8)
        assert torch.equal(keys, whole.keys[i]) and torch.equal(values, whole.values[i])
    assert_same_kv(whole, kv, codec)
    with pytest.raises(IndexError):
        head.layer_range(9)


def test_the_head_is_found_from_the_first_bytes_alone():
    _, kv = random_kv(14, shape=(30, 3, 300, 8))
    data = encode(kv)
    need = head_nbytes(data[:8])  # the prefix tells where the header ends
    assert need == _header_end(data)
    need = head_nbytes(data[:need])  # the header tells where the token ids end
    assert need == _header_end(data) + 8 * 300 == head_nbytes(data)
    head = parse_head(data[:need])
    assert head.head_nbytes == need and head.layer_range(0)[0] == need
    with pytest.raises(CorruptEntryError):
        parse_head(data[:need - 1])  # the token ids are covered by the header digest


@pytest.mark.parametrize("codec", CODECS)
def test_a_flipped_byte_in_one_layer_fails_that_layer_only(codec):
    _, kv = random_kv(15, shape=(9, 2, 11, 8))
    data = bytearray(encode(kv, codec))
    head = parse_head(bytes(data))
    offset, length = head.layer_range(7)
    data[offset + length // 3] ^= 0x10
    for i in range(9):
        start, n = head.layer_range(i)
        if i == 7:
            with pytest.raises(CorruptEntryError, match="layer 7"):
                decode_layer(head, i, bytes(data[start:start + n]))
        else:
            decode_layer(head, i, bytes(data[start:start + n]))
    with pytest.raises(CorruptEntryError, match="layer 7"):
        decode(bytes(data))
    with pytest.raises(CorruptEntryError):
        decode_layer(head, 3, bytes(data[head.layer_range(3)[0]:][:10]))  # a short section


def test_decoded_layers_are_fresh_tensors():
    _, kv = random_kv(16)
    data = encode(kv)
    head = parse_head(data)
    offset, length = head.layer_range(1)
    keys, _ = decode_layer(head, 1, memoryview(data)[offset:offset + length])
    keys.zero_()  # writable, and not a view of the entry's bytes
    assert_same_kv(decode(data), kv)
