"""Tiers on their own: LRU by bytes, disk restarts and leftovers, byte ranges, Redis prefix/TTL/password."""
from __future__ import annotations

import os
import time

import diskcache
import pytest
import torch

from common.chunk_kv import ChunkKV
from store import BytesTier, DiskTier, Entry, MemoryTier, RedisTier
from store.eviction import LRUPolicy
from tests.helpers import random_kv
from tests.servers import RedisServer

A, B, C, D = (c * 64 for c in "abcd")  # valid keys


def test_lru_policy_evicts_least_recent_first():
    lru = LRUPolicy(300)
    assert lru.add(A, 100) == [] and lru.add(B, 100) == [] and lru.add(C, 100) == []
    lru.touch(A)
    assert lru.add(D, 150) == [B, C]  # A was touched, so B and C are the oldest
    assert lru.keys() == [A, D] and lru.nbytes == 250
    assert lru.add(A, 400) == [A] and lru.keys() == [D]  # bigger than the cap: only itself goes
    assert lru.add(D, 10) == [] and lru.nbytes == 10  # re-adding replaces the size


@pytest.fixture(params=["memory", "disk"])
def local_tier(request, tmp_path):
    return BytesTier(250) if request.param == "memory" else DiskTier(tmp_path, 250)


def test_local_tier_is_lru_by_bytes(local_tier):
    local_tier.put_bytes(A, b"a" * 100)
    local_tier.put_bytes(B, b"b" * 100)
    assert local_tier.get_bytes(A) == b"a" * 100  # A is now more recent than B
    local_tier.put_bytes(C, b"c" * 100)
    assert local_tier.get_bytes(B) is None and not local_tier.contains(B)
    assert local_tier.get_bytes(A) == b"a" * 100 and local_tier.get_bytes(C) == b"c" * 100
    assert sorted(local_tier.keys()) == [A, C]
    stats = local_tier.stats()
    assert (stats["entries"], stats["bytes"], stats["evictions"]) == (2, 200, 1)
    local_tier.put_bytes(D, b"d" * 251)  # larger than the cap: refused, nothing evicted for it
    assert not local_tier.contains(D) and local_tier.stats()["entries"] == 2
    assert local_tier.delete(A) and not local_tier.delete(A)
    assert local_tier.stats()["bytes"] == 100


def test_victims_name_what_a_put_would_evict_without_evicting_it(local_tier):
    assert local_tier.victims(100) == []  # free room
    local_tier.put_bytes(A, b"a" * 100)
    time.sleep(0.002)  # distinct access times on disk
    local_tier.put_bytes(B, b"b" * 100)
    assert local_tier.victims(50) == [] and local_tier.victims(100) == [A] and local_tier.victims(200) == [A, B]
    assert local_tier.victims(251) is None  # larger than the cap
    assert local_tier.contains(A) and local_tier.contains(B) and local_tier.stats()["evictions"] == 0


def test_memory_tier_hands_back_the_tensors_it_holds_and_keeps_its_cap():
    kvs = [random_kv(i, shape=(2, 2, 5, 4))[1] for i in range(4)]  # 640 bytes each
    tier = MemoryTier(2 * kvs[0].nbytes + 100)
    tier.put(A, Entry.of_tensors(kvs[0], "fp16"))
    tier.put(B, Entry.of_tensors(kvs[1], "fp16"))
    held = tier.held(A)
    assert held.keys.data_ptr() == kvs[0].keys.data_ptr()  # placed already: held as given, no copy
    assert tier.get(A).kv.keys is held.keys and tier.get(A).kv.values is held.values  # every hit: the same tensors
    tier.put(C, Entry.of_tensors(kvs[2], "fp16"))  # over the cap: B, the least recently used, goes
    assert not tier.contains(B) and tier.contains(A) and tier.contains(C)
    stats = tier.stats()
    assert (stats["entries"], stats["bytes"], stats["evictions"]) == (2, 2 * kvs[0].nbytes, 1)
    assert stats["bytes"] <= stats["capacity"]
    tier.put(D, Entry.of_tensors(random_kv(9, shape=(2, 2, 50, 4))[1], "fp16"))  # larger than the cap: refused
    assert not tier.contains(D) and tier.stats()["entries"] == 2


def test_memory_tier_copies_only_what_is_not_placed_yet():
    kv = random_kv(1, shape=(2, 2, 5, 4))[1]
    tier = MemoryTier(1 << 20, device="cpu", name="gpu")  # the gpu tier's code, on the CPU
    strided = ChunkKV(kv.keys.transpose(2, 3).contiguous().transpose(2, 3), kv.values, kv.token_ids,
                      kv.position, kv.context_hash, kv.fingerprint)  # same values, not contiguous
    tier.put(A, Entry.of_tensors(strided, "fp16"))
    held = tier.held(A)
    assert held.keys.is_contiguous() and held.keys.data_ptr() != strided.keys.data_ptr()
    assert torch.equal(held.keys, kv.keys) and held.values.data_ptr() == kv.values.data_ptr()
    assert tier.stats()["device"] == "cpu" and tier.name == "gpu"


def _files(root) -> list:
    return sorted(p for p in root.rglob("*.val"))


def test_disk_eviction_removes_files(tmp_path):
    tier = DiskTier(tmp_path, 250)
    for key, fill in ((A, b"a"), (B, b"b"), (C, b"c")):
        tier.put_bytes(key, fill * 100)
    assert sorted(p.read_bytes() for p in _files(tmp_path)) == [b"b" * 100, b"c" * 100]
    tier.put_bytes(C, b"C" * 120)  # replacing an entry swaps its file and its size
    assert sorted(p.read_bytes() for p in _files(tmp_path)) == [b"C" * 120, b"b" * 100]
    assert tier.stats()["bytes"] == 220


def test_disk_restart_keeps_index_and_recency(tmp_path):
    tier = DiskTier(tmp_path, 1000)
    for i, key in enumerate((A, B, C)):
        tier.put_bytes(key, bytes([i]) * (100 + i))
        time.sleep(0.002)  # distinct access times
    tier.get_bytes(A)  # a hit refreshes A: now B is the least recent
    tier.close()

    again = DiskTier(tmp_path, 1000)
    assert sorted(again.keys()) == [A, B, C]
    assert again.stats()["bytes"] == 100 + 101 + 102
    again.close()

    smaller = DiskTier(tmp_path, 250)  # a lower cap on start evicts the least recent: B
    assert sorted(smaller.keys()) == [A, C] and smaller.stats()["bytes"] == 202
    assert smaller.stats()["evictions"] == 1 and len(_files(tmp_path)) == 2
    assert smaller.get_bytes(A) == bytes([0]) * 100


def test_disk_open_sweeps_crash_leftovers_and_format_1_files(tmp_path):
    tier = DiskTier(tmp_path, 1000)
    tier.put_bytes(A, b"a" * 10)
    [kept] = _files(tmp_path)
    old_orphan = kept.with_name("0" * 24 + ".val")  # a put that crashed before the index saw it
    old_orphan.write_bytes(b"half a write")
    an_hour_ago = time.time() - 3600
    os.utime(old_orphan, (an_hour_ago, an_hour_ago))
    new_orphan = kept.with_name("1" * 24 + ".val")  # may be another process's put in progress
    new_orphan.write_bytes(b"being written")
    (tmp_path / "bb").mkdir()
    (tmp_path / "bb" / f"{B}.kv").write_bytes(b"RBKV format 1")  # the tier this one replaced
    (tmp_path / "bb" / ".x.tmp").write_bytes(b"its temp file")
    (tmp_path / "notes.txt").write_text("not ours")

    DiskTier(tmp_path, 1000)
    assert not old_orphan.exists() and new_orphan.exists() and kept.exists()
    assert not (tmp_path / "bb" / f"{B}.kv").exists() and not (tmp_path / "bb" / ".x.tmp").exists()
    assert (tmp_path / "notes.txt").exists()


def test_disk_file_vanishing_is_a_miss_and_leaves_the_index(tmp_path, caplog):
    tier = DiskTier(tmp_path, 1000)
    tier.put_bytes(A, b"a" * 10)
    tier.put_bytes(B, b"b" * 10)
    _files(tmp_path)[0].unlink()
    _files(tmp_path)[0].unlink()
    assert tier.get_bytes(A) is None and tier.reader(B) is None
    assert tier.stats()["entries"] == 0 and tier.stats()["bytes"] == 0 and not tier.contains(A)
    assert tier.stats()["errors"] == 2
    assert sum(r.levelname == "WARNING" for r in caplog.records) == 1  # once per failure streak


def test_disk_reader_reads_byte_ranges(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20)
    data = bytes(range(256)) * 100
    tier.put_bytes(A, data)
    reader = tier.reader(A)
    assert reader.read(0, 8) == data[:8] and reader.read(1000, 300) == data[1000:1300]
    assert reader.read(len(data) - 4, 100) == data[-4:]  # short at the end
    tier.delete(A)  # an open reader keeps reading what it opened
    assert reader.read(5000, 10) == data[5000:5010]
    reader.close()
    assert tier.reader(A) is None and tier.head(A, 4) is None


def test_disk_head_does_not_touch_recency(tmp_path):
    tier = DiskTier(tmp_path, 250)
    tier.put_bytes(A, b"a" * 100)
    time.sleep(0.002)
    tier.put_bytes(B, b"b" * 100)
    assert tier.head(A, 3) == b"aaa"  # unlike get, head leaves A the least recent
    tier.put_bytes(C, b"c" * 100)
    assert sorted(tier.keys()) == [B, C]


UNPICKLED = []


class _Boom:
    def __reduce__(self):
        return UNPICKLED.append, ("unpickled!",)


def test_disk_values_are_bytes_only(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20)
    with pytest.raises(TypeError):
        tier._cache.set(A, {"a": 1})  # diskcache would pickle it
    other = diskcache.Cache(str(tmp_path))  # someone else's writer on our directory
    other.set(A, _Boom())  # pickled
    other.set(B, 12345)  # inline in SQLite
    other.set(C, b"x" * 100_000)  # bytes in a file: the one kind the tier reads
    assert tier.get_bytes(A) is None and tier.reader(B) is None and not UNPICKLED
    assert not tier.contains(A) and not tier.contains(B)  # unreadable entries are dropped
    assert tier.get_bytes(C) == b"x" * 100_000


def test_redis_tier_round_trip_prefix_ttl(redis_url, redis_server):
    tier = RedisTier(redis_url, prefix="test:", ttl_s=60)
    tier.put_bytes(A, b"\x00binary\xff")
    assert tier.get_bytes(A) == b"\x00binary\xff" and tier.contains(A)
    assert tier.head(A, 4) == b"\x00bin" and tier.head(B, 4) is None
    with redis_server.client() as raw:
        assert raw.get("test:" + A) == b"\x00binary\xff"
        assert 0 < raw.ttl("test:" + A) <= 60
        raw.set("test:not-a-key", b"x")
        raw.set("other:" + B, b"x")
    assert list(tier.keys()) == [A]  # only valid keys under our prefix
    assert tier.delete(A) and not tier.delete(A) and tier.get_bytes(A) is None
    tier.close()


def test_redis_reader_reads_byte_ranges(redis_url, redis_server):
    tier = RedisTier(redis_url)
    data = bytes(range(256)) * 300  # longer than the first read the reader keeps
    tier.put_bytes(A, data)
    tier.put_bytes(B, b"short")
    assert tier.reader(C) is None
    reader = tier.reader(A)
    assert reader.read(0, 8) == data[:8] and reader.read(70000, 500) == data[70000:70500]
    assert reader.read(len(data) - 4, 100) == data[-4:]
    assert tier.reader(B).read(2, 100) == b"ort"
    tier.delete(A)
    assert reader.read(70000, 500) == b""  # gone: the caller sees a short read
    with redis_server.client() as raw:
        raw.set("ragblend:" + A, data)
    redis_server.pause()
    try:
        assert RedisTier(redis_url, timeout_s=0.2).reader(A) is None  # unreachable: a miss
    finally:
        redis_server.resume()


def test_redis_tier_password():
    with RedisServer(password="s3cret") as server:
        assert RedisTier(server.url, password="s3cret").put_bytes(A, b"ok") is None
        assert RedisTier(server.url, password="s3cret").get_bytes(A) == b"ok"
        anonymous = RedisTier(server.url, backoff_s=60)
        assert anonymous.get_bytes(A) is None  # refused, reported as a miss
        assert anonymous.stats()["errors"] == 1
