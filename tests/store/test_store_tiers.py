"""Tiers on their own: LRU by bytes, disk restarts, Redis prefix/TTL/password."""
from __future__ import annotations

import os
import time

import pytest

from store import DiskTier, MemoryTier, RedisTier
from store.eviction import LRUPolicy
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
    return MemoryTier(250) if request.param == "memory" else DiskTier(tmp_path, 250)


def test_local_tier_is_lru_by_bytes(local_tier):
    local_tier.put(A, b"a" * 100)
    local_tier.put(B, b"b" * 100)
    assert local_tier.get(A) == b"a" * 100  # A is now more recent than B
    local_tier.put(C, b"c" * 100)
    assert local_tier.get(B) is None and not local_tier.contains(B)
    assert local_tier.get(A) == b"a" * 100 and local_tier.get(C) == b"c" * 100
    assert sorted(local_tier.keys()) == [A, C]
    stats = local_tier.stats()
    assert (stats["entries"], stats["bytes"], stats["evictions"]) == (2, 200, 1)
    local_tier.put(D, b"d" * 251)  # larger than the cap: refused, nothing evicted for it
    assert not local_tier.contains(D) and local_tier.stats()["entries"] == 2
    assert local_tier.delete(A) and not local_tier.delete(A)
    assert local_tier.stats()["bytes"] == 100


def test_disk_eviction_removes_files_and_leaves_no_temp_files(tmp_path):
    tier = DiskTier(tmp_path, 250)
    for key in (A, B, C):
        tier.put(key, b"x" * 100)
    files = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    assert files == [f"{B}.kv", f"{C}.kv"]
    assert (tmp_path / "bb" / f"{B}.kv").read_bytes() == b"x" * 100  # fanned out by 2 hex chars


def test_disk_restart_rebuilds_index_and_recency(tmp_path):
    tier = DiskTier(tmp_path, 1000)
    now = time.time()
    for i, key in enumerate((A, B, C)):
        tier.put(key, bytes([i]) * (100 + i))
        os.utime(tier._path(key), (now - 100 + i, now - 100 + i))  # A oldest, C newest
    tier.get(A)  # a hit refreshes A's mtime: now B is the oldest
    (tmp_path / "aa" / ".leftover.tmp").write_bytes(b"half a write")  # from a crash
    (tmp_path / "notes.txt").write_text("not an entry")

    again = DiskTier(tmp_path, 1000)
    assert sorted(again.keys()) == [A, B, C]
    assert again.stats()["bytes"] == 100 + 101 + 102
    assert not (tmp_path / "aa" / ".leftover.tmp").exists()

    smaller = DiskTier(tmp_path, 250)  # a lower cap on start evicts the least recent: B
    assert sorted(smaller.keys()) == [A, C] and smaller.stats()["bytes"] == 202
    assert not smaller._path(B).exists()
    assert smaller.get(A) == bytes([0]) * 100


def test_disk_file_vanishing_is_a_miss(tmp_path):
    tier = DiskTier(tmp_path, 1000)
    tier.put(A, b"a" * 10)
    tier._path(A).unlink()
    assert tier.get(A) is None and tier.stats()["entries"] == 0


def test_redis_tier_round_trip_prefix_ttl(redis_url, redis_server):
    tier = RedisTier(redis_url, prefix="test:", ttl_s=60)
    tier.put(A, b"\x00binary\xff")
    assert tier.get(A) == b"\x00binary\xff" and tier.contains(A)
    assert tier.head(A, 4) == b"\x00bin" and tier.head(B, 4) is None
    with redis_server.client() as raw:
        assert raw.get("test:" + A) == b"\x00binary\xff"
        assert 0 < raw.ttl("test:" + A) <= 60
        raw.set("test:not-a-key", b"x")
        raw.set("other:" + B, b"x")
    assert list(tier.keys()) == [A]  # only valid keys under our prefix
    assert tier.delete(A) and not tier.delete(A) and tier.get(A) is None
    tier.close()


def test_redis_tier_password():
    with RedisServer(password="s3cret") as server:
        assert RedisTier(server.url, password="s3cret").put(A, b"ok") is None
        assert RedisTier(server.url, password="s3cret").get(A) == b"ok"
        anonymous = RedisTier(server.url, backoff_s=60)
        assert anonymous.get(A) is None  # refused, reported as a miss
        assert anonymous.stats()["errors"] == 1
