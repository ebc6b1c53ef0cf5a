"""The compressed codecs (store/codecs.py): int4 (KIVI) and cachegen (quantised + ANS-coded with fitted
tables): their per-element bounds, sizes, damage caught in any layer, unknown tables as misses, and every
tier giving back the same KV."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from blend import Blender, ChunkKV, cpu_kernels
from store import (
    CacheGenTables,
    CorruptEntryError,
    DiskTier,
    KVMismatchError,
    MemoryTier,
    RedisTier,
    StoreSettings,
    TieredStore,
    bytes_per_token,
    decode,
    encode,
    get_codec,
    kv_key,
    register_tables,
)
from store.codecs import CODEC_NAMES, DEFAULT_BINS, KEY_GROUP, BinPlan
from store.serialize import MAGIC, _canonical, _header_digest, decode_layer, head_nbytes, parse_head
from store.tables import TablesShelf, shared_tables, tables_name
from tests.blend.conftest import random_ids, tiny_model
from tests.helpers import assert_same_kv, codec_error_bound, random_kv

SHAPE = (4, 3, 17, 8)  # random_kv's


@pytest.fixture(scope="module")
def cachegen():
    """The cachegen codec with tables fitted on random chunks of SHAPE (model-a)."""
    return register_tables(CacheGenTables.fit([random_kv(1000 + i)[1] for i in range(4)], DEFAULT_BINS))


# --- int4 ------------------------------------------------------------------------------------------

@settings(max_examples=20, deadline=None)
@given(shape=st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 130), st.integers(1, 9)),
       magnitude=st.sampled_from([1e-3, 1.0, 300.0]), constant_token=st.booleans(), seed=st.integers(0, 2**16))
def test_int4_stays_within_half_a_step_of_a_tight_scale(shape, magnitude, constant_token, seed):
    _, kv = random_kv(seed, shape=shape)
    kv.keys *= magnitude
    kv.values += magnitude  # an offset: what the zero point is for
    if constant_token:
        kv.values[:, :, 0] = 0.25  # a constant slice comes back exactly
    got = decode(encode(kv, "int4"))
    assert_same_kv(got, kv, "int4")
    if constant_token:
        assert (got.values[:, :, 0] == 0.25).all()
    # The scale is the group's range over the levels, rounded up by at most a few fp16 ulps (a constant
    # group's is 1: any scale is exact there).
    _, v_bound = codec_error_bound("int4", kv)
    v_range = (kv.values.amax(-1, keepdim=True) - kv.values.amin(-1, keepdim=True)) / 15
    tight = 2 * v_bound <= v_range * (1 + 2**-8) + kv.values.abs().amax(-1, keepdim=True) * 2**-9 + 1e-7
    assert (tight | (v_range == 0)).all()


def test_int4_keys_are_grouped_per_channel_over_tokens():
    # One token group of a channel holds a spike: only that group's step grows.
    _, kv = random_kv(1, shape=(1, 1, 2 * KEY_GROUP, 4))
    kv.keys[0, 0, 3, 1] = 1000.0
    k_bound, _ = codec_error_bound("int4", kv)
    assert k_bound[0, 0, 0, 1] > 30 and k_bound[0, 0, KEY_GROUP, 1] < 1 and k_bound[0, 0, 0, 2] < 1
    assert_same_kv(decode(encode(kv, "int4")), kv, "int4")


@pytest.mark.parametrize("shape", [(30, 3, 512, 64), (32, 8, 512, 128)])  # SmolLM2-135M, Llama-3-8B
def test_int4_is_under_0_3x_fp16(shape):
    assert bytes_per_token("int4", shape) <= 0.30 * bytes_per_token("fp16", shape)
    L, H, T, D = shape  # two values a byte, an fp16 scale and zero per key group and per value token
    assert bytes_per_token("int4", shape) == L * (H * D + 4 * H * D // KEY_GROUP + 4 * H) + 8


@pytest.mark.parametrize("codec", ["int4", "cachegen"])
def test_quantising_codecs_refuse_what_fp16_scales_cannot_hold(codec, cachegen):
    for bad in (float("nan"), float("inf"), 1e7):
        _, kv = random_kv(3)
        kv.keys[1, 0, 2, 0] = bad
        with pytest.raises(ValueError, match="inf or nan"):
            encode(kv, cachegen if codec == "cachegen" else codec)


# --- cachegen ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cachegen_round_trips_within_half_a_step_exactly_as_its_quantiser(cachegen, dtype):
    _, kv = random_kv(5, context=[1, 2], dtype=dtype)
    kv.values[:, :, 4] = 0  # an all-zero token
    data = encode(kv, cachegen)
    got = decode(data, "model-a")
    assert_same_kv(got, kv, "cachegen")
    assert (got.values[:, :, 4] == 0).all()
    want = get_codec("cachegen").round_trip(kv)  # the coding is lossless: quality is the quantiser's alone
    assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
    assert json.loads(data[8:8 + int.from_bytes(data[4:8], "little")])["tables"] == cachegen.tables.id


def test_cachegen_uses_more_bins_where_its_plan_says():
    plan = BinPlan.of({"keys": [[0, 64], [2, 8]], "values": [[0, 8]]})
    _, kv = random_kv(6)
    packed = get_codec("cachegen", bins=plan).pack(kv.keys, kv.values)
    amax = kv.keys.abs().amax(dim=(1, 3), keepdim=True)  # [L, 1, T, 1]: one scale per (layer, token)
    assert packed["k_scale"].shape == (4, 1, 17, 1)
    assert torch.allclose(packed["k_scale"][:2].float(), amax[:2] / 31, rtol=2**-10)  # 64 bins: symbols +-31
    assert torch.allclose(packed["k_scale"][2:].float(), amax[2:] / 3, rtol=2**-10)  # 8 bins: +-3
    assert packed["keys"][:2].abs().max() == 31 and packed["keys"][2:].abs().max() == 3


def test_cachegen_layers_vary_in_size_and_each_decodes_alone(cachegen):
    _, kv = random_kv(7, shape=SHAPE, context=[5])
    kv.keys[3, :, :, 1:] = 0  # a layer whose keys sit in one channel: peaked symbols, a short stream
    data = encode(kv, cachegen)
    whole = decode(data)
    head = parse_head(data[:head_nbytes(data)], "model-a")
    assert head.nbytes == len(data) and head.coder is cachegen
    lengths = [head.layer_range(i)[1] for i in range(4)]
    assert len(set(lengths)) > 1 and all(n % 8 == 0 for n in lengths)
    for i in reversed(range(4)):
        offset, length = head.layer_range(i)
        keys, values = decode_layer(head, i, data[offset:offset + length])
        assert torch.equal(keys, whole.keys[i]) and torch.equal(values, whole.values[i])


def _entry_with(data: bytes, sections: dict[int, bytes] | None = None, **header_changes) -> bytes:
    """`data` with some layer sections replaced and header fields changed, offsets and digests made consistent:
    an entry that is well-formed as a container, whatever its streams hold."""
    from store.serialize import digest

    head = parse_head(data)
    header = dict(head.header) | header_changes
    ids = data[head.payload_start:head.head_nbytes]
    raw = [data[slice(*(lambda o, n: (o, o + n))(*head.layer_range(i)))] for i in range(head.num_layers)]
    for i, section in (sections or {}).items():
        raw[i] = section
    at, layers = len(ids), []
    for section in raw:
        layers.append([at, len(section), digest(section)])
        at += len(section)
    header["layers"] = layers
    header["digest"] = _header_digest(header, ids)
    text = _canonical(header)
    text += b" " * (-(8 + len(text)) % 8)
    return MAGIC + struct.pack("<I", len(text)) + text + ids + b"".join(raw)


def test_every_flipped_byte_of_a_cachegen_entry_is_caught(cachegen):
    _, kv = random_kv(8, shape=(4, 3, 3, 8))  # the tables' layers and channels, few tokens
    data = encode(kv, cachegen)
    for pos in range(len(data)):
        bad = bytearray(data)
        bad[pos] ^= 0x01
        with pytest.raises((CorruptEntryError, KVMismatchError)):
            decode(bytes(bad), "model-a")


@pytest.mark.parametrize("layer", range(SHAPE[0]))
def test_a_damaged_or_truncated_stream_in_any_layer_is_caught_even_past_the_digests(cachegen, layer):
    _, kv = random_kv(9)
    data = encode(kv, cachegen)
    head = parse_head(data)
    offset, length = head.layer_range(layer)
    section = bytearray(data[offset:offset + length])
    words = struct.unpack_from("<I", section)[0]
    stream_at = 8 + 4 * SHAPE[2]
    truncated = bytearray(section[:stream_at + 4 * (words - 2)])
    struct.pack_into("<I", truncated, 0, words - 2)
    truncated += bytes(-len(truncated) % 8)
    flipped = bytearray(section)
    flipped[stream_at + 4 * (words // 2)] ^= 0x04
    for bad in (truncated, flipped):
        entry = _entry_with(data, {layer: bytes(bad)})  # digests made to match: only the stream can tell
        with pytest.raises(CorruptEntryError, match=f"layer {layer}"):
            decode(entry, verify_checksum=False)
        with pytest.raises(CorruptEntryError, match=f"layer {layer}"):
            decode(entry)
    with pytest.raises(CorruptEntryError):  # cut short: the digests see it first
        decode(data[:offset + length - 8])


def test_entries_of_unknown_tables_are_quiet_misses_then_rewritten(tmp_path, cachegen):
    store = TieredStore([DiskTier(tmp_path / "kv", 1 << 24)], codec=cachegen, fingerprint="model-a")
    key, kv = random_kv(10)
    store.put(key, kv)
    path = next((tmp_path / "kv").rglob("*.val"))
    path.write_bytes(_entry_with(path.read_bytes(), tables="0" * 64))  # another replica's tables, say
    assert store.open(key) is None and store.get(key) is None and not store.contains(key)
    assert (store.stats()["stale"], store.stats()["corrupt"]) == (1, 0)
    stored = store.put(key, kv)  # the miss, recomputed, is written with this process's tables
    got = store.get(key)
    assert torch.equal(got.keys, stored.keys) and torch.equal(got.values, stored.values)
    store.close()


def test_tables_are_fitted_deterministically_and_serialised_without_pickle(cachegen):
    samples = [random_kv(1000 + i)[1] for i in range(4)]
    again = CacheGenTables.fit(samples, DEFAULT_BINS)
    assert again.id == cachegen.tables.id and np.array_equal(again.counts, cachegen.tables.counts)
    other = CacheGenTables.fit(samples[:3], DEFAULT_BINS)
    assert other.id != again.id
    data = again.to_bytes()
    header = json.loads(data[8:8 + struct.unpack_from("<Q", data)[0]])  # safetensors: a JSON header, raw arrays
    assert header["counts"]["dtype"] == "I32" and header["__metadata__"]["id"] == again.id
    loaded = CacheGenTables.from_bytes(data)
    assert loaded.id == again.id and loaded.plan == DEFAULT_BINS and loaded.fingerprint == "model-a"
    damaged = bytearray(data)
    damaged[-5] ^= 0x01  # a count
    for bad in (bytes(damaged), data[:-4], b"not tables"):
        with pytest.raises(ValueError):
            CacheGenTables.from_bytes(bad)
    assert (again.counts[:, :, :, :again.bins.min() - 1] > 0).all()  # every symbol codable


def test_tables_code_only_their_shape_and_the_codec_needs_them(cachegen):
    _, kv = random_kv(11, shape=(4, 3, 17, 16))
    with pytest.raises(ValueError, match="cannot code"):
        encode(kv, cachegen)
    with pytest.raises(ValueError, match="fitted tables"):
        encode(kv, "cachegen")


@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_a_memory_hit_equals_a_disk_hit_equals_a_redis_hit(tmp_path, redis_url, cachegen, codec):
    codec = cachegen if codec == "cachegen" else codec
    key, kv = random_kv(12, context=[3])
    tiers = {"memory": MemoryTier(1 << 24), "disk": DiskTier(tmp_path / "kv", 1 << 24),
             "redis": RedisTier(redis_url, timeout_s=5.0)}
    hits = {}
    for name, tier in tiers.items():
        with TieredStore([tier], codec=codec, fingerprint="model-a") as store:
            stored = store.put(key, kv)
            store.flush()
            hits[name] = store.get(key)
            with store.open(key) as entry:
                layers = [entry.layer(i) for i in range(entry.num_layers)]
            assert all(torch.equal(k, hits[name].keys[i]) and torch.equal(v, hits[name].values[i])
                       for i, (k, v) in enumerate(layers))
        assert torch.equal(hits[name].keys, stored.keys) and torch.equal(hits[name].values, stored.values)
    assert_same_kv(hits["redis"], kv, getattr(codec, "name", codec))


# --- the blend loop: a damaged layer is a miss, recomputed --------------------------------------------

HEAD, CHUNKS, SUFFIX = random_ids(7, 1), [random_ids(23, 2), random_ids(31, 3)], random_ids(9, 5)


@pytest.mark.parametrize("layer", [0, 2, 3])
def test_a_damaged_cachegen_layer_is_recomputed_with_correct_logits(tmp_path, layer):
    blender = Blender(tiny_model("llama"), tokenizer=None, fingerprint="tiny-llama")
    head = blender.precompute(HEAD)
    computed = [blender.precompute(ids, HEAD, context=head) for ids in CHUNKS]
    codec = register_tables(CacheGenTables.fit(computed, DEFAULT_BINS))
    with TieredStore([DiskTier(tmp_path / "kv", 1 << 26)], codec=codec) as store:
        keys = [kv_key(kv.fingerprint, kv.context_hash, kv.token_ids) for kv in computed]
        stored = [store.put(key, kv) for key, kv in zip(keys, computed)]
        reference = blender.prefill([head, *stored], SUFFIX, 0.3)
        path = store.tiers[0]._cache.peek_file(keys[1])
        data = bytearray(open(path, "rb").read())
        offset, length = parse_head(bytes(data)).layer_range(layer)
        data[offset + length - 12] ^= 0x10  # in the stream's last words
        open(path, "wb").write(bytes(data))
        asked = []

        def recompute(index: int) -> ChunkKV:
            asked.append(index)
            return stored[index - 1]  # what recomputing the chunk gives; index 0 is the head

        entries = [store.open(key) for key in keys]
        result = blender.prefill([head, *entries], SUFFIX, 0.3, pipeline=True, recompute=recompute)
        assert asked == [2] and result.stats.reloaded_chunks == 1
        assert torch.equal(result.logits, reference.logits)
        assert store.open(keys[1]) is None and store.stats()["corrupt"] == 1



# --- a codec per tier --------------------------------------------------------------------------------

def test_each_tier_keeps_its_own_codec_and_a_promotion_keeps_the_bytes_it_found(tmp_path, redis_url, cachegen):
    codecs = {"memory": "native", "disk": "int4", "redis": cachegen}
    def tiers():
        return [MemoryTier(1 << 24), DiskTier(tmp_path / "kv", 1 << 24), RedisTier(redis_url, timeout_s=5.0)]
    key, kv = random_kv(20, context=[1])
    with TieredStore(tiers(), codec=codecs, fingerprint="model-a") as store:
        assert store.codecs == {"memory": "native", "disk": "int4", "redis": "cachegen"} and store.codec == "native"
        stored = store.put(key, kv)
        store.flush()
        assert torch.equal(stored.keys, kv.keys)  # the fastest tier's form: native, exact
        disk, redis = store.tiers[1], store.tiers[2]
        assert parse_head(disk.get_bytes(key)).codec == "int4" and parse_head(redis.get_bytes(key)).codec == "cachegen"
        assert store.stats()["codecs"] == store.codecs
    with TieredStore(tiers()[1:], codec=codecs, fingerprint="model-a") as store:  # a new process: no memory
        assert_same_kv(store.get(key), kv, "int4")  # from disk
        store.tiers[0].delete(key)
        from_redis = store.get(key)  # cachegen, promoted to disk as the bytes Redis held
        assert_same_kv(from_redis, kv, "cachegen")
        assert parse_head(store.tiers[0].get_bytes(key)).codec == "cachegen"
        assert torch.equal(store.get(key).keys, from_redis.keys)
    with pytest.raises(ValueError, match="no codec for tier 'disk'"):
        TieredStore(tiers()[1:2], codec={"memory": "native"})


def test_store_settings_take_one_codec_or_one_per_tier():
    assert StoreSettings(codec="int4").codecs() == dict.fromkeys(("gpu", "memory", "disk", "redis"), "int4")
    per_tier = StoreSettings(codec={"disk": "int4", "redis": "cachegen"})
    assert per_tier.codec_of("memory") == "int8" and per_tier.codec_of("redis") == "cachegen"
    for bad in ({"dsk": "int4"}, {"disk": "int2"}, "bf8"):
        with pytest.raises(ValueError):
            StoreSettings(codec=bad)
    with pytest.raises(ValueError, match="start at layer 0"):
        StoreSettings(cachegen_bins={"keys": [[2, 16]], "values": [[0, 16]]})


# --- the tables' shelf ------------------------------------------------------------------------------

def _fit_counting(samples, plan=DEFAULT_BINS):
    calls = []

    def fit() -> CacheGenTables:
        calls.append(1)
        return CacheGenTables.fit(samples, plan)
    return fit, calls


def test_tables_are_fitted_once_and_shared_through_the_file_and_redis(tmp_path, redis_url):
    samples = [random_kv(1000 + i)[1] for i in range(4)]
    fit, calls = _fit_counting(samples)
    first = shared_tables(TablesShelf(tmp_path / "a", redis_url), "model-a", DEFAULT_BINS, fit)
    assert calls == [1] and (tmp_path / "a" / tables_name("model-a", DEFAULT_BINS)).exists()
    # Another host (its own directory) sharing Redis adopts them; so does another process on the first host.
    for directory in ("b", "a"):
        again = shared_tables(TablesShelf(tmp_path / directory, redis_url), "model-a", DEFAULT_BINS, fit)
        assert again.id == first.id and calls == [1]
    # A replica whose own fit differs (another device's rounding, say) still codes with the first one's.
    other_fit, other_calls = _fit_counting(samples[:2])
    shelf = TablesShelf(tmp_path / "c", redis_url)
    shelf.delete(tables_name("model-a", DEFAULT_BINS))  # as if it looked before the first replica wrote
    assert shelf.put_if_absent(tables_name("model-a", DEFAULT_BINS), other_fit().to_bytes()) != b""
    adopted = shared_tables(TablesShelf(tmp_path / "d", redis_url), "model-a", DEFAULT_BINS, fit)
    assert adopted.id == CacheGenTables.fit(samples[:2], DEFAULT_BINS).id and calls == [1]


def test_damaged_or_foreign_tables_are_refitted_and_no_redis_is_no_failure(tmp_path):
    samples = [random_kv(1000 + i)[1] for i in range(4)]
    fit, calls = _fit_counting(samples)
    shelf = TablesShelf(tmp_path, "redis://127.0.0.1:1/0", timeout_s=0.2)  # nothing listens: the file alone
    name = tables_name("model-a", DEFAULT_BINS)
    tables = shared_tables(shelf, "model-a", DEFAULT_BINS, fit)
    (tmp_path / name).write_bytes((tmp_path / name).read_bytes()[:-3])  # damaged
    assert shared_tables(shelf, "model-a", DEFAULT_BINS, fit).id == tables.id and calls == [1, 1]
    foreign = CacheGenTables.fit([random_kv(7, fingerprint="model-b")[1]], DEFAULT_BINS)
    (tmp_path / name).write_bytes(foreign.to_bytes())  # another model's under this name
    assert shared_tables(shelf, "model-a", DEFAULT_BINS, fit).id == tables.id and calls == [1, 1, 1]
    with pytest.raises(ValueError, match="not this model"):
        shared_tables(TablesShelf(tmp_path / "x"), "model-b", DEFAULT_BINS, fit)


@pytest.mark.parametrize("codec", ["fp16", "int8", "int4", "int8 kernel"])
@pytest.mark.parametrize("spans", [[(5, 13), (13, 77), (90, 91), (120, 184)], [(5, 13), (13, 77), (77, 78), (78, 140)]])
def test_a_prefills_round_trip_of_spans_is_each_spans_entry_read_back(codec, spans, monkeypatch):
    """round_trip_spans (what a prefill attends to for the spans the store keeps) equals, bit for bit, the round
    trip of each span's own entry, however many spans, of whatever lengths, apart or one after another, and leaves
    the rest of the layer alone; int8's in one pass where the CPU kernels are loaded, else through torch's ops."""
    if codec == "int8 kernel" and cpu_kernels.load() is None:
        pytest.skip(f"no CPU kernels: {cpu_kernels.unavailable()}")
    monkeypatch.setattr(cpu_kernels, "loaded", lambda: codec == "int8 kernel")
    coder = get_codec(codec.split()[0])
    torch.manual_seed(3)
    keys, values = torch.randn(1, 3, 256, 16)[:, :, :200] * 4, torch.randn(1, 3, 200, 16)  # a layer: [1, H, N, D]
    keys[:, :, 50:60, 2] *= 100  # an outlier channel in one span
    keys[:, 1, 5:13, 3], values[:, 2, 90] = 0, 0  # all-zero slices: any scale is exact
    want_k, want_v = keys.clone(), values.clone()
    for start, end in spans:
        kv = ChunkKV(keys[:, :, start:end].clone(), values[:, :, start:end].clone(), torch.arange(end - start), start,
                     "ctx", "model")
        read = coder.round_trip(kv)
        want_k[:, :, start:end], want_v[:, :, start:end] = read.keys, read.values
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        coder.round_trip_spans(keys, values, spans)
    assert torch.equal(keys, want_k) and torch.equal(values, want_v)
    ran = {event.name for event in profile.events()}
    assert ("ragblend::int8_round_trip" in ran) == (codec == "int8 kernel")
    assert not get_codec("cachegen").layerwise  # its bins follow a layer's place among all: never rounded a layer alone
