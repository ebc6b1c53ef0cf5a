"""TieredStore: lookups through the chain, bad entries as misses, Redis outages, replicas, threads,
close and delete against the background writer."""
from __future__ import annotations

import contextlib
import logging
import random
import threading
import time

import pytest
import torch

from common.placement import HOST, Placement
from store import (
    CODECS,
    BytesTier,
    DiskTier,
    KVMismatchError,
    MemoryTier,
    RedisTier,
    StoreClosedError,
    StoreSettings,
    TieredStore,
    build_store,
    encode,
)
from store.factory import gpu_bytes
from tests.helpers import all_layers, assert_same_kv, random_kv, run_in_threads

FP = "model-a"


def make_store(tmp_path, redis_url=None, *, memory=True, disk=True, codec="fp16", name="r1",
               memory_bytes=1 << 20, disk_bytes=1 << 20, **redis_kw) -> TieredStore:
    tiers = []
    if memory:
        tiers.append(MemoryTier(memory_bytes))
    if disk:
        tiers.append(DiskTier(tmp_path / name, disk_bytes))
    if redis_url:
        tiers.append(RedisTier(redis_url, **({"timeout_s": 0.2, "backoff_s": 0.3} | redis_kw)))
    return TieredStore(tiers, codec=codec, fingerprint=FP)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("only", ["memory", "disk", "redis"])
def test_round_trip_per_codec_and_tier(tmp_path, redis_url, codec, only):
    store = make_store(tmp_path, redis_url if only == "redis" else None, codec=codec,
                       memory=only == "memory", disk=only == "disk")
    key, kv = random_kv(0, context=[7, 8])
    assert store.get(key) is None
    store.put(key, kv)
    store.flush()
    assert store.contains(key)
    assert_same_kv(store.get(key), kv, codec)
    stats = store.stats()
    assert (stats["hits"], stats["misses"], stats["puts"]) == (1, 1, 1)
    assert stats["tiers"][only]["hits"] == 1 and stats["tiers"][only]["load_ms_mean"] > 0
    store.close()


def test_hits_are_promoted_to_faster_tiers(tmp_path, redis_url):
    key, kv = random_kv(1)
    with make_store(tmp_path, redis_url, name="writer") as writer:
        writer.put(key, kv)
    reader = make_store(tmp_path, redis_url, name="reader")  # empty memory and disk
    found, tier = reader.get_with_tier(key)
    assert_same_kv(found, kv)
    assert tier == "redis"
    assert reader.tiers[0].contains(key) and reader.tiers[1].contains(key)
    found, tier = reader.get_with_tier(key)
    assert_same_kv(found, kv)
    assert tier == "memory"
    tiers = reader.stats()["tiers"]
    assert (tiers["redis"]["hits"], tiers["memory"]["hits"], tiers["memory"]["misses"]) == (1, 1, 1)
    reader.close()


def test_memory_and_disk_caps_evict_by_bytes(tmp_path):
    entry_bytes = len(encode(random_kv(0)[1]))
    kv_bytes = random_kv(0)[1].nbytes  # the memory tier holds tensors in the model's dtype
    store = make_store(tmp_path, memory_bytes=2 * kv_bytes, disk_bytes=3 * entry_bytes)
    keys = [store.put(k, kv) and k for k, kv in (random_kv(i) for i in range(5))]
    stats = store.stats()["tiers"]
    assert stats["memory"]["entries"] == 2 and stats["memory"]["bytes"] == 2 * kv_bytes
    assert stats["disk"]["entries"] == 3 and stats["disk"]["evictions"] == 2
    assert store.get(keys[0]) is None and store.get(keys[4]) is not None


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_damaged_disk_file_is_a_miss_and_is_removed(tmp_path, damage):
    key, kv = random_kv(2)
    make_store(tmp_path, memory=False).put(key, kv)
    path = next((tmp_path / "r1").rglob("*.val"))
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data[: {"flip": len(data), "truncate": len(data) - 7, "empty": 0}[damage]]))

    store = make_store(tmp_path)
    assert store.get(key) is None
    assert not path.exists() and not store.contains(key)
    assert store.stats()["corrupt"] == 1 and store.stats()["tiers"]["disk"]["corrupt"] == 1


def test_damaged_disk_entry_falls_through_to_a_good_redis_copy(tmp_path, redis_url):
    key, kv = random_kv(3)
    with make_store(tmp_path, redis_url) as store:
        store.put(key, kv)
    path = next((tmp_path / "r1").rglob("*.val"))
    path.write_bytes(path.read_bytes()[:-1])
    store = make_store(tmp_path, redis_url, memory=False)
    assert_same_kv(store.get(key), kv)  # served from Redis, then rewritten to disk
    assert_same_kv(make_store(tmp_path, memory=False).get(key), kv)
    store.close()


def test_truncated_redis_value_is_a_miss_and_is_removed(tmp_path, redis_url, redis_server):
    key, kv = random_kv(4)
    with make_store(tmp_path, redis_url, name="writer") as store:
        store.put(key, kv)
    with redis_server.client() as raw:
        name = "ragblend:" + key
        raw.set(name, raw.get(name)[:-100])
        reader = make_store(tmp_path, redis_url, name="reader")
        assert reader.get(key) is None
        assert raw.exists(name) == 0
    assert reader.stats()["tiers"]["redis"]["corrupt"] == 1
    reader.close()


def test_other_models_entries_are_refused_and_dropped(tmp_path):
    store = make_store(tmp_path)
    key_b, kv_b = random_kv(5, fingerprint="model-b")
    with pytest.raises(KVMismatchError):
        store.put(key_b, kv_b)
    # Model B's KV planted under the key model A would use for the same tokens: a miss, deleted.
    key_a = random_kv(5, fingerprint=FP)[0]
    store.tiers[1].put_bytes(key_a, encode(kv_b))
    assert store.get(key_a) is None and not store.tiers[1].contains(key_a)
    assert store.stats()["corrupt"] == 1


def test_an_entry_must_sit_under_its_own_key(tmp_path):
    store = make_store(tmp_path)
    key1, kv1 = random_kv(6)
    key2, _ = random_kv(7)
    with pytest.raises(KVMismatchError):
        store.put(key2, kv1)
    store.tiers[1].put_bytes(key2, encode(kv1))  # a valid disk entry, but of other tokens
    assert store.get(key2) is None and not store.tiers[1].contains(key2)
    with pytest.raises(ValueError):
        store.get("../" + key1[3:])


def _serve_during_outage(store: TieredStore, kvs: dict, seed: int) -> None:
    """150 calls a request path would make."""
    absent = [random_kv(i)[0] for i in range(1000 + seed, 1010 + seed)]
    for round_ in range(10):
        for key, kv in kvs.items():
            assert_same_kv(store.get(key), kv)  # local tiers keep serving
        for key in absent:
            assert store.get(key) is None  # looks in Redis: times out once, then skips it
        store.put(*random_kv(seed + round_))  # never waits for Redis


def test_redis_outage_is_survived_and_recovered(tmp_path, redis_server, redis_url, caplog):
    store = make_store(tmp_path, redis_url)  # timeout 0.2 s, back-off 0.3 s
    kvs = dict(random_kv(i) for i in range(10, 14))
    for key, kv in kvs.items():
        store.put(key, kv)
    store.flush()
    caplog.set_level(logging.WARNING, logger="ragblend.store")

    redis_server.pause()  # hung: every call would wait out the timeout without the back-off
    _serve_during_outage(store, kvs, seed=200)
    redis_server.stop()  # then dead
    _serve_during_outage(store, kvs, seed=300)
    store.flush()
    redis_stats = store.stats()["tiers"]["redis"]
    # The back-off, counted rather than timed: most of the 300 calls skipped Redis instead of waiting on it.
    assert redis_stats["errors"] >= 1 and redis_stats["skipped"] > 100 and not redis_stats["available"]
    assert redis_stats["outages"] == 1
    assert sum("unreachable" in r.getMessage() for r in caplog.records) == 1  # once per outage

    redis_server.start()  # back, empty, same port
    time.sleep(0.35)  # past the back-off
    key, kv = random_kv(400)
    store.put(key, kv)
    store.flush()
    with redis_server.client() as raw:
        assert raw.exists("ragblend:" + key)
    assert store.stats()["tiers"]["redis"]["available"]
    assert any("is back" in r.getMessage() for r in caplog.records)
    other = make_store(tmp_path, redis_url, name="r2")
    assert_same_kv(other.get(key), kv)
    other.close()
    store.close()


def test_two_replicas_share_redis(tmp_path, redis_url):
    one = make_store(tmp_path, redis_url, name="one")
    two = make_store(tmp_path, redis_url, name="two")
    key, kv = random_kv(20)
    assert two.get(key) is None
    one.put(key, kv)
    one.flush()
    assert_same_kv(two.get(key), kv)
    assert two.stats()["tiers"]["redis"]["hits"] == 1
    one.close()
    two.close()


def test_concurrent_gets_and_puts_never_see_partial_entries(tmp_path, redis_url):
    entries = dict(random_kv(i, shape=(2, 2, 33, 8)) for i in range(8))
    entry_bytes = len(encode(next(iter(entries.values()))))
    store = make_store(tmp_path, redis_url, memory_bytes=3 * entry_bytes, disk_bytes=4 * entry_bytes)
    keys, seen = list(entries), []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(80):
            key = rng.choice(keys)
            if (draw := rng.random()) < 0.4:
                store.put(key, entries[key])
            elif draw < 0.6:
                with store.open(key) or contextlib.nullcontext() as entry:
                    if entry is not None:
                        assert_same_kv(all_layers(entry), entries[key])
                        seen.append(key)
            else:
                got = store.get(key)
                if got is not None:
                    assert_same_kv(got, entries[key])
                    seen.append(key)

    run_in_threads(worker, 4)
    store.close()
    assert seen and store.stats()["corrupt"] == 0
    files = list((tmp_path / "r1").rglob("*.val"))
    assert len(files) == store.tiers[1].stats()["entries"]  # nothing written but not indexed
    assert sum(f.stat().st_size for f in files) == store.tiers[1].stats()["bytes"] <= 4 * entry_bytes
    after = make_store(tmp_path, redis_url, name="r1")  # what is left on disk and in Redis is whole
    for key, kv in entries.items():
        if (got := after.get(key)) is not None:
            assert_same_kv(got, kv)
    assert after.stats()["corrupt"] == 0


def test_full_write_queue_drops_instead_of_blocking(tmp_path):
    class StuckRemote(BytesTier):  # a tier written behind, whose writes hang
        name, trusted = "stuck", False

        def __init__(self) -> None:
            self.release = threading.Event()
            super().__init__(1 << 20, write_behind=2)

        def put_bytes(self, key: str, data: bytes) -> None:
            self.release.wait()
            super().put_bytes(key, data)

    stuck = StuckRemote()
    store = TieredStore([MemoryTier(1 << 20), stuck], fingerprint=FP)
    for i in range(6):  # all return while the remote's writes hang: a put that waited would never return
        store.put(*random_kv(i))
    dropped = store.stats()["dropped_writes"]
    assert 3 <= dropped <= 4  # two fit in the queue, plus one in the writer's hands if it took one
    stuck.release.set()
    store.close()  # flushes what was queued
    assert stuck.stats()["entries"] == 6 - dropped


def test_gc_drops_other_models_and_unreadable_entries(tmp_path):
    store = TieredStore([MemoryTier(1 << 20), DiskTier(tmp_path, 1 << 20)])  # accepts any model
    mine = dict(random_kv(i) for i in range(3))
    theirs = dict(random_kv(i, fingerprint="model-b") for i in range(3, 5))
    for key, kv in (mine | theirs).items():
        store.put(key, kv)
    junk = random_kv(9)[0]
    store.tiers[1].put_bytes(junk, b"RBKV garbage")

    report = store.gc(keep_fingerprint=FP)
    assert report["memory"] == {"scanned": 5, "dropped": 2, "entries": 3, "bytes": report["memory"]["bytes"]}
    assert report["disk"]["scanned"] == 6 and report["disk"]["dropped"] == 3 and report["disk"]["entries"] == 3
    assert all(store.get(k) is not None for k in mine) and all(not store.contains(k) for k in theirs)


def test_build_store_from_settings(tmp_path, redis_url):
    settings = StoreSettings(codec="int8", memory_bytes=1 << 20, disk_bytes=1 << 20, redis_url=redis_url,
                             redis_prefix="t:", redis_ttl_s=30)
    store = build_store(settings, tmp_path / "kv", FP)
    assert [t.name for t in store.tiers] == ["memory", "disk", "redis"] and store.codec == "int8"
    key, kv = random_kv(30)
    store.put(key, kv)
    store.close()
    replica = build_store(settings, tmp_path / "kv2", FP)
    assert_same_kv(replica.get(key), kv, "int8")
    assert replica.stats()["tiers"]["redis"]["hits"] == 1
    replica.close()

    no_memory = build_store(StoreSettings(memory_bytes=0), tmp_path / "kv", FP)
    assert [t.name for t in no_memory.tiers] == ["disk"]
    with pytest.raises(KVMismatchError):
        no_memory.put(*random_kv(31, fingerprint="model-b"))
    no_memory.close()


def test_the_gpu_tier_is_built_only_for_a_model_off_the_host(tmp_path):
    assert gpu_bytes("auto", HOST) == gpu_bytes(1 << 30, HOST) == 0
    on_host = build_store(StoreSettings(gpu_bytes=1 << 30, read_threads=0), tmp_path / "kv", FP, HOST)
    assert [t.name for t in on_host.tiers] == ["memory", "disk"] and on_host._pool is None
    assert not on_host.tiers[0].pin  # pinned host memory only when the placement says
    on_host.close()
    # A model off the host, the device played by the CPU: the gpu tier's code and cap, on "device" memory.
    off_host = Placement(torch.device("cpu"), on_host=False, device_free_bytes=10 << 30)
    assert gpu_bytes("auto", off_host) == 2 << 30 and gpu_bytes(1 << 20, off_host) == 1 << 20
    with build_store(StoreSettings(gpu_bytes=1 << 20), tmp_path / "kv", FP, off_host) as store:
        assert [t.name for t in store.tiers] == ["gpu", "memory", "disk"] and store.placement is off_host
        key, kv = random_kv(32)
        store.put(key, kv)
        assert store.tiers[0].held(key) is not None and store.get_with_tier(key)[1] == "gpu"
    if torch.cuda.is_available():
        free = torch.cuda.mem_get_info()[0]
        cuda = Placement(torch.device("cuda"), on_host=False, pin=True, device_free_bytes=free)
        assert 0 < gpu_bytes("auto", cuda) < free
        on_gpu = build_store(StoreSettings(), tmp_path / "kv", FP, cuda)
        assert [t.name for t in on_gpu.tiers][:2] == ["gpu", "memory"] and on_gpu.tiers[1].pin
        on_gpu.close()
    with pytest.raises(ValueError):
        StoreSettings(gpu_bytes=-1)


# --- close, flush and delete against the background writer ---------------------------------------

class GatedRedis(RedisTier):
    """A real Redis tier whose background puts wait at a gate, before or after the SET lands."""

    def __init__(self, url: str, when: str) -> None:
        super().__init__(url, timeout_s=2.0)
        self.when, self.gate, self.entered = when, threading.Event(), threading.Event()

    def put_bytes(self, key: str, data: bytes) -> None:  # what the tier's write-behind thread calls
        self.entered.set()
        if self.when == "before":
            self.gate.wait(10)
        super().put_bytes(key, data)
        if self.when == "after":
            self.gate.wait(10)


@pytest.mark.parametrize("when", ["before", "after"])
def test_delete_wins_over_writes_queued_before_it(tmp_path, redis_url, redis_server, when):
    remote = GatedRedis(redis_url, when)
    store = TieredStore([MemoryTier(1 << 20), remote], fingerprint=FP)
    key, kv = random_kv(40)
    other_key, other_kv = random_kv(41)
    store.put(key, kv)  # the writer takes this one and waits at the gate, SET done or not
    assert remote.entered.wait(5)
    store.put(key, kv)  # queued behind it
    store.put(other_key, other_kv)
    assert store.delete(key)  # from memory now; Redis has no copy yet, or one about to be undone
    remote.gate.set()
    store.flush()
    with redis_server.client() as raw:
        assert not raw.exists("ragblend:" + key)
        assert raw.exists("ragblend:" + other_key)  # other keys' writes still land
    assert store.get(key) is None

    store.put(key, kv)  # a write after the delete lands as usual
    store.flush()
    with redis_server.client() as raw:
        assert raw.exists("ragblend:" + key)
    assert remote.write_behind._tombstones == {}  # spent once the writes they guard are done
    store.close()


def test_close_races_puts_without_losing_or_stranding_writes(tmp_path, redis_url, redis_server):
    store = TieredStore([MemoryTier(1 << 24), RedisTier(redis_url, timeout_s=2.0, queue_size=8)], fingerprint=FP)
    entries = [random_kv(i, shape=(2, 1, 4, 4)) for i in range(400)]
    accepted, refused = [], []

    def putter(part: list) -> None:
        for key, kv in part:
            try:
                store.put(key, kv)
                accepted.append(key)
            except StoreClosedError:
                refused.append(key)

    threads = [threading.Thread(target=putter, args=(entries[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while not accepted and time.monotonic() < deadline:  # puts under way (not a guess at how long that takes)
        time.sleep(0.001)
    closers = [threading.Thread(target=store.close) for _ in range(2)]  # two at once: both return
    for t in closers:
        t.start()
    for t in threads + closers:
        t.join(10)
    assert not any(t.is_alive() for t in threads + closers)
    flusher = threading.Thread(target=store.flush)  # after close: returns, nothing left stranded
    flusher.start()
    flusher.join(5)
    assert not flusher.is_alive()
    assert len(accepted) + len(refused) == 400 and accepted
    with redis_server.client() as raw:
        landed = sum(raw.exists("ragblend:" + k) for k in accepted)
    assert landed == len(accepted) - store.stats()["dropped_writes"]  # each write landed or was counted
    for call in (lambda: store.put(*entries[0]), lambda: store.get(entries[0][0]),
                 lambda: store.open(entries[0][0]), lambda: store.delete(entries[0][0])):
        with pytest.raises(StoreClosedError):
            call()


def test_entries_of_an_older_format_are_quiet_misses_then_rewritten(tmp_path, caplog):
    store = make_store(tmp_path, memory=False)
    key, kv = random_kv(42)
    store.put(key, kv)
    path = next((tmp_path / "r1").rglob("*.val"))
    data = path.read_bytes()
    end = 8 + int.from_bytes(data[4:8], "little")
    header = data[8:end].replace(b'"v":3', b'"v":2')  # what the previous build wrote
    path.write_bytes(data[:8] + header + data[end:])
    caplog.set_level(logging.DEBUG, logger="ragblend.store")
    assert store.get(key) is None and not store.contains(key)
    stats = store.stats()
    assert (stats["stale"], stats["corrupt"], stats["tiers"]["disk"]["stale"]) == (1, 0, 1)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    store.put(key, kv)  # the miss was recomputed: written back in this format
    assert_same_kv(store.get(key), kv) and store.stats()["stale"] == 1
