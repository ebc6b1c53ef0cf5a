"""The store feeding a model: codecs unpacked on the model's device, the gpu tier (run here on the CPU,
the same code), read-ahead against serial reads, and damage in any layer never reaching attention."""
from __future__ import annotations

import pytest
import torch

from blend import Blender
from store import (
    BytesTier,
    DiskTier,
    LayerReadError,
    MemoryTier,
    RedisTier,
    ResidentEntry,
    TieredStore,
    get_codec,
    kv_key,
)
from store.serialize import decode_layer, encode, parse_head
from tests.blend.conftest import TEST_DEVICE, random_ids, tiny_model
from tests.helpers import all_layers, assert_same_kv, random_kv

HEAD, CHUNKS, SUFFIX = random_ids(7, 1), [random_ids(23, 2), random_ids(31, 3), random_ids(17, 4)], random_ids(9, 5)


@pytest.fixture(scope="module")
def blender() -> Blender:
    return Blender(tiny_model("llama", num_hidden_layers=6), tokenizer=None, fingerprint="tiny-llama", check_layer=2)


def put_chunks(blender: Blender, store: TieredStore) -> tuple:
    """(the head's KV, the chunks' keys, the chunks' KV as put returned it: what a miss serves)."""
    head = blender.precompute(HEAD)
    keys, served = [], []
    for ids in CHUNKS:
        kv = blender.precompute(ids, HEAD, context=head)
        keys.append(kv_key(blender.fingerprint, kv.context_hash, kv.token_ids))
        served.append(store.put(keys[-1], kv))
    store.flush()
    return head, keys, served


def prefill(blender, head, sources, pipeline=True):
    return blender.prefill([head, *sources], SUFFIX, 0.3, pipeline=pipeline)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("codec", ["native", "fp16", "int8"])
def test_each_codec_unpacks_on_the_device_in_the_models_dtype(codec, dtype):
    _, kv = random_kv(3, shape=(3, 2, 9, 8), dtype=dtype)
    data = encode(kv, codec)
    head = parse_head(data)
    offset, length = head.layer_range(1)
    keys, values = decode_layer(head, 1, data[offset:offset + length], device=TEST_DEVICE)
    assert keys.device.type == TEST_DEVICE.type and keys.dtype == values.dtype == dtype
    want = get_codec(codec).round_trip(kv)
    assert torch.equal(keys.cpu(), want.keys[1]) and torch.equal(values.cpu(), want.values[1])
    assert_same_kv(want, kv, codec)  # native exact, fp16 exact to the fp16 cast, int8 within scale / 2


def test_int8_crosses_as_int8_and_is_dequantised_after_the_copy():
    _, kv = random_kv(4, shape=(2, 2, 9, 8))
    parts = {name: t[0] for name, t in get_codec("int8").pack(kv.keys, kv.values).items()}
    seen = {name: t.dtype for name, t in parts.items()}  # what .to(device) is handed: the parts as stored
    assert seen == {"keys": torch.int8, "values": torch.int8, "k_scale": torch.float32, "v_scale": torch.float32}
    keys, _ = get_codec("int8").unpack(parts, TEST_DEVICE, torch.bfloat16)
    assert keys.dtype == torch.bfloat16 and keys.device.type == TEST_DEVICE.type
    assert torch.equal(keys.float().cpu(), (parts["keys"] * parts["k_scale"]).to(torch.bfloat16).float())


def test_the_gpu_tier_evicts_to_its_cap_and_a_hit_gives_the_logits_of_a_miss(blender, tmp_path):
    _, _, sized = put_chunks(blender, TieredStore([], fingerprint=blender.fingerprint))
    cap = sized[1].nbytes + sized[2].nbytes + 100  # room for the last two chunks, not all three
    gpu = MemoryTier(cap, device=TEST_DEVICE, name="gpu")
    store = TieredStore([gpu, MemoryTier(1 << 26), DiskTier(tmp_path / "kv", 1 << 26)], fingerprint=blender.fingerprint)
    head, keys, served = put_chunks(blender, store)
    stats = gpu.stats()
    assert stats["entries"] == 2 and stats["evictions"] == 1 and stats["bytes"] <= cap
    assert not gpu.contains(keys[0]) and gpu.contains(keys[2])  # the least recently put went

    miss = prefill(blender, head, served)  # just computed: what a miss serves
    entries = [store.open(k) for k in keys]
    assert [e.tier for e in entries] == ["memory", "gpu", "gpu"]
    assert isinstance(entries[1], ResidentEntry)
    hit = prefill(blender, head, entries)
    assert torch.equal(hit.logits, miss.logits)
    # chunk 0 was read whole from memory: promoted into the gpu tier on close, evicting the coldest
    assert gpu.contains(keys[0]) and gpu.stats()["bytes"] <= cap
    k, _ = store.open(keys[0]).layer(0, TEST_DEVICE, blender.dtype)
    assert k.data_ptr() == gpu.held(keys[0]).keys[0].data_ptr()  # on the device in the dtype: no copy
    store.close()


@pytest.mark.parametrize("codec", ["native", "fp16", "int8"])
def test_parallel_reads_give_exactly_the_logits_of_serial_reads(blender, tmp_path, redis_url, codec):
    def store(name: str, threads: int) -> TieredStore:
        return TieredStore([DiskTier(tmp_path / name, 1 << 26), RedisTier(redis_url, prefix=f"{name}:")],
                           codec=codec, fingerprint=blender.fingerprint, read_threads=threads)

    serial, parallel = store("serial", 0), store("parallel", 4)
    head, keys, served = put_chunks(blender, serial)
    put_chunks(blender, parallel)
    want = prefill(blender, head, served, pipeline=False)
    for tiers in (serial.tiers, parallel.tiers):
        tiers[0].delete(keys[1])  # chunk 1 from Redis, the others from disk
    for pipeline in (False, True):
        a = prefill(blender, head, [serial.open(k) for k in keys], pipeline)
        b = prefill(blender, head, [parallel.open(k) for k in keys], pipeline)
        assert torch.equal(a.logits, b.logits) and torch.equal(a.logits, want.logits)
    assert parallel.stats()["tiers"]["redis"]["layer_reads"] > 0
    serial.close()
    parallel.close()


def flip(tier, key: str, layer: int, redis_server) -> None:
    """Flip one byte in the middle of `layer`'s section of `key`'s entry in `tier` (disk or Redis)."""
    if tier.name == "disk":
        path = tier._cache.peek_file(key)
        data = bytearray(open(path, "rb").read())
    else:
        with redis_server.client() as raw:
            data = bytearray(raw.get("ragblend:" + key))
    offset, length = parse_head(bytes(data)).layer_range(layer)
    data[offset + length // 2] ^= 0x10
    if tier.name == "disk":
        open(path, "wb").write(bytes(data))
    else:
        with redis_server.client() as raw:
            raw.set("ragblend:" + key, bytes(data))


@pytest.mark.parametrize("only", ["disk", "redis"])
def test_one_flipped_byte_in_any_layer_is_caught(tmp_path, redis_url, redis_server, only):
    L = 6
    for layer in range(L):
        tier = DiskTier(tmp_path / f"{layer}", 1 << 24) if only == "disk" else RedisTier(redis_url)
        store = TieredStore([tier], fingerprint="model-a")
        key, kv = random_kv(layer, shape=(L, 2, 40, 8))
        store.put(key, kv)
        store.flush()
        flip(tier, key, layer, redis_server)
        with store.open(key) as entry, pytest.raises(LayerReadError) as caught:
            all_layers(entry)
        assert caught.value.corrupt and not tier.contains(key)  # dropped: recomputed next time
        store.put(key, kv)
        store.flush()
        flip(tier, key, layer, redis_server)
        assert store.get(key) is None and store.stats()["corrupt"] == 2
        store.close()


def test_a_corrupt_entry_never_reaches_attention(blender, tmp_path):
    store = TieredStore([BytesTier(1 << 26)], fingerprint=blender.fingerprint)
    store.tiers[0].trusted = False  # checked like a disk entry
    head, keys, served = put_chunks(blender, store)
    want = prefill(blender, head, served)
    data = bytearray(store.tiers[0].get_bytes(keys[2]))
    offset, length = parse_head(bytes(data)).layer_range(4)
    data[offset + 1] ^= 0x01
    store.tiers[0].put_bytes(keys[2], bytes(data))
    recomputed = []
    got = blender.prefill([head, *(store.open(k) for k in keys)], SUFFIX, 0.3, pipeline=True,
                          recompute=lambda i: recomputed.append(i) or served[i - 1])  # segment 0 is the head
    assert recomputed == [3] and got.stats.reloaded_chunks == 1  # chunk 2's layer 4 failed its checksum
    assert torch.equal(got.logits, want.logits) and not store.tiers[0].contains(keys[2])
    store.close()
