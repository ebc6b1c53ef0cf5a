"""The one tier interface (store.base): an Entry gives either form, a tensor tier and a byte tier behind the
same walk give the same ChunkKV, and each tier's background work stops with it."""
from __future__ import annotations

import threading

import pytest
import torch

from store import CODECS, BytesTier, DiskTier, Entry, MemoryTier, RedisTier, TieredStore, decode, encode, get_codec
from tests.helpers import all_layers, random_kv

FP = "model-a"


def test_an_entry_makes_the_form_it_lacks_once():
    key, kv = random_kv(1)
    encodes = []

    def encoded() -> bytes:
        encodes.append(1)
        return encode(kv, "int8")

    entry = Entry(get_codec("int8").round_trip(kv), encoded)
    assert not encodes  # made on first ask, not before
    datas = []
    threads = [threading.Thread(target=lambda: datas.append(entry.data)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(encodes) == 1 and all(d is datas[0] for d in datas)
    from_bytes = Entry.of_bytes(entry.data)
    assert torch.equal(from_bytes.kv.keys, entry.kv.keys) and from_bytes.kv is from_bytes.kv


@pytest.mark.parametrize("codec", CODECS)
def test_a_computed_entry_encodes_the_kv_itself_and_holds_what_a_hit_reads_back(codec):
    _, kv = random_kv(2, dtype=torch.bfloat16)
    entry = Entry.computed(kv, codec)
    assert entry.data == encode(kv, codec)  # not the round trip encoded again (int8 scales would move)
    back = decode(entry.data)
    assert torch.equal(entry.kv.keys, back.keys) and torch.equal(entry.kv.values, back.values)


@pytest.mark.parametrize("codec", CODECS)
def test_a_tensor_tier_and_a_byte_tier_behind_the_same_walk_give_the_same_kv(tmp_path, codec):
    key, kv = random_kv(3, shape=(5, 2, 11, 8), context=[4, 2])
    tensors = TieredStore([MemoryTier(1 << 20)], codec=codec, fingerprint=FP)
    checked_bytes = DiskTier(tmp_path / "disk", 1 << 20)
    bytes_ = TieredStore([checked_bytes], codec=codec, fingerprint=FP)
    served = [store.put(key, kv) for store in (tensors, bytes_)]
    assert torch.equal(served[0].keys, served[1].keys)  # what a miss serves, whichever tier keeps it
    got = [store.get_with_tier(key) for store in (tensors, bytes_)]
    assert [tier for _, tier in got] == ["memory", "disk"]
    for (found, _), want in zip(got, served):
        assert torch.equal(found.keys, want.keys) and torch.equal(found.values, want.values)
    for store in (tensors, bytes_):
        with store.open(key) as entry:
            layers = all_layers(entry)
        assert torch.equal(layers.keys, served[0].keys) and torch.equal(layers.values, served[0].values)
        assert store.stats()["hits"] == 2 and store.counts()[store.tiers[0].name]["layer_reads"] == 5

    both = TieredStore([MemoryTier(1 << 20), DiskTier(tmp_path / "disk", 1 << 20)], codec=codec, fingerprint=FP)
    from_disk, tier = both.get_with_tier(key)  # promoted into memory by the same walk
    from_memory, again = both.get_with_tier(key)
    assert (tier, again) == ("disk", "memory") and torch.equal(from_disk.keys, from_memory.keys)
    for store in (tensors, bytes_, both):
        store.close()


def _threads(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


class GatedBytes(BytesTier):
    """An in-process tier written behind, whose writes wait at a gate."""

    def __init__(self) -> None:
        self.gate, self.landed = threading.Event(), []
        super().__init__(1 << 20, write_behind=8)

    def put_bytes(self, key: str, data: bytes) -> None:
        self.gate.wait(10)
        self.landed.append(key)
        super().put_bytes(key, data)


def test_a_tier_written_behind_finishes_its_writes_and_stops_its_thread_when_closed():
    before = set(_threads("ragblend-store-writer"))
    tier = GatedBytes()
    keys = [random_kv(i)[0] for i in range(3)]
    for i, key in enumerate(keys):
        tier.put(key, Entry.computed(random_kv(i)[1], "fp16"))
    assert tier.stats()["write_queue"] >= 2 and not tier.landed  # queued, not written by the caller
    (thread,) = set(_threads("ragblend-store-writer")) - before
    tier.gate.set()
    tier.close()
    assert tier.landed == keys and all(tier.contains(k) for k in keys) and not thread.is_alive()
    tier.put(random_kv(9)[0], Entry.computed(random_kv(9)[1], "fp16"))  # after close: dropped, counted
    assert tier.stats()["dropped_writes"] == 1 and tier.stats()["entries"] == 3


def test_closing_the_store_stops_every_tiers_background_work(tmp_path, redis_url):
    before = set(threading.enumerate())
    store = TieredStore([MemoryTier(1 << 20), DiskTier(tmp_path, 1 << 20), RedisTier(redis_url)], fingerprint=FP)
    key, kv = random_kv(4, shape=(6, 2, 9, 8))
    store.put(key, kv)
    with store.open(key) as entry:  # from memory; the disk entry below is read ahead on the pool
        all_layers(entry)
    store.tiers[0].delete(key)
    with store.open(key) as entry:
        all_layers(entry)
    started = set(threading.enumerate()) - before
    assert {t.name.rsplit("_", 1)[0] for t in started} >= {"ragblend-store-writer", "ragblend-store-read"}
    store.close()
    assert not [t for t in started if t.is_alive()]
    assert RedisTier(redis_url).contains(key)  # the queued write was done before the writer stopped


def test_gc_is_each_tiers_own_and_redis_keeps_other_models_entries(tmp_path, redis_url):
    store = TieredStore([DiskTier(tmp_path, 1 << 20), RedisTier(redis_url)])
    mine, theirs = random_kv(5), random_kv(6, fingerprint="model-b")
    for key, kv in (mine, theirs):
        store.put(key, kv)
    store.flush()
    report = store.gc(keep_fingerprint=FP)
    assert list(report) == ["disk"] and report["disk"]["dropped"] == 1  # Redis ages its entries out itself
    assert store.tiers[1].contains(theirs[0]) and not store.tiers[0].contains(theirs[0])
    store.close()
