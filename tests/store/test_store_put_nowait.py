"""TieredStore.put_nowait: the caller only hands the chunk over; the store's writer thread encodes and writes it.
Tiers whose writes wait at a gate (an Event the test opens) show what happens meanwhile: reads find the pending
chunk as a hit will read it back, the queue is bounded, deletes win, errors stay in the background, close drains.
Then the admission policy (store/admission.py): one-off chunks stay out of the byte tiers."""
from __future__ import annotations

import logging
import threading

import pytest
import torch

from retrieval import open_metadata
from store import BytesTier, DiskTier, MemoryTier, StoreSettings, TieredStore, build_store, encode
from store.admission import Admission, Sightings
from tests.helpers import assert_same_kv, random_kv

FP = "model-a"


class GatedMemory(MemoryTier):
    """A memory tier whose puts wait at a gate; `entered` is set once the writer is inside a put."""

    def __init__(self) -> None:
        super().__init__(1 << 20)
        self.gate, self.entered = threading.Event(), threading.Event()

    def put(self, key, entry) -> None:
        self.entered.set()
        assert self.gate.wait(10), "the test never opened the gate"
        super().put(key, entry)


class FailingBytes(BytesTier):
    def put_bytes(self, key: str, data: bytes) -> None:
        raise OSError("disk full")


def gated_store(tmp_path, **kw) -> tuple[TieredStore, GatedMemory]:
    gated = GatedMemory()
    return TieredStore([gated, DiskTier(tmp_path / "disk", 1 << 20)], codec="int8", fingerprint=FP, **kw), gated


def test_put_nowait_returns_while_the_write_waits_and_reads_find_the_pending_chunk(tmp_path):
    store, gated = gated_store(tmp_path)
    key, kv = random_kv(0)
    assert store.put_nowait(key, kv)  # returns although no tier has taken it
    assert gated.entered.wait(10) and not gated.contains(key) and not store.tiers[1].contains(key)
    pending, tier = store.get_with_tier(key)
    assert tier == "memory" and store.contains(key)
    assert_same_kv(pending, kv, "int8")  # as a hit reads it back: the codec's round trip
    with store.open(key) as entry:
        assert torch.equal(entry.layer(2)[0], pending.keys[2])
    assert store.stats()["pending"] == 1 and store.stats()["pending_hits"] == 2
    gated.gate.set()
    store.flush()
    stored = store.get(key)
    assert torch.equal(stored.keys, pending.keys) and torch.equal(stored.values, pending.values)  # the same tensors
    assert store.tiers[1].contains(key)
    stats = store.stats()
    assert (stats["pending"], stats["pending_bytes"], stats["puts"], stats["queued_puts"]) == (0, 0, 1, 1)
    store.close()


def test_a_full_queue_drops_the_chunk_at_once_and_counts_it(tmp_path):
    store, gated = gated_store(tmp_path, write_queue=2)
    chunks = [random_kv(i) for i in range(5)]
    assert store.put_nowait(*chunks[0]) and gated.entered.wait(10)  # in flight
    assert [store.put_nowait(*c) for c in chunks[1:]] == [True, True, False, False]  # two wait, then no room
    assert store.get(chunks[4][0]) is None  # a dropped chunk is a clean miss
    gated.gate.set()
    store.flush()
    assert [store.contains(k) for k, _ in chunks] == [True, True, True, False, False]
    assert store.stats()["dropped_puts"] == 2
    store.close()


def test_the_byte_cap_on_pending_chunks_drops_too(tmp_path):
    (first, kv), (second, kv2) = random_kv(0), random_kv(1)
    store, gated = gated_store(tmp_path, write_queue_bytes=kv.nbytes)
    assert store.put_nowait(first, kv) and not store.put_nowait(second, kv2)
    gated.gate.set()
    store.flush()
    assert store.stats()["pending_bytes"] == 0 and store.put_nowait(second, kv2)  # room again once written
    store.close()


def test_a_delete_wins_over_a_pending_write(tmp_path):
    store, gated = gated_store(tmp_path)
    (busy, kv0), (key, kv) = random_kv(0), random_kv(1)
    store.put_nowait(busy, kv0)
    gated.entered.wait(10)
    store.put_nowait(key, kv)  # queued behind the one in flight
    assert store.delete(key) and store.get(key) is None
    gated.gate.set()
    store.flush()
    assert not store.contains(key) and store.contains(busy) and store.stats()["pending_bytes"] == 0
    store.close()


def test_a_failed_background_write_is_logged_counted_and_a_clean_miss(tmp_path, caplog):
    store = TieredStore([FailingBytes(1 << 20)], codec="int8", fingerprint=FP)
    key, kv = random_kv(0)
    with caplog.at_level(logging.ERROR, logger="ragblend.store"):
        assert store.put_nowait(key, kv)  # the caller hears nothing of the failure
        store.flush()
    assert store.stats()["put_errors"] == 1 and "background write" in caplog.text
    assert store.get(key) is None and store.stats()["pending"] == 0
    store.close()


def test_close_writes_every_chunk_handed_over(tmp_path):
    others = {t for t in threading.enumerate() if t.name == "ragblend-store-put"}  # other tests' stores
    store, gated = gated_store(tmp_path)
    chunks = [random_kv(i) for i in range(3)]
    for key, kv in chunks:
        store.put_nowait(key, kv)
    threading.Timer(0.05, gated.gate.set).start()
    store.close()  # waits for the gate, then for every queued write
    assert store.stats()["puts"] == 3
    disk = DiskTier(tmp_path / "disk", 1 << 20)  # the store's own is closed
    assert all(disk.contains(k) for k, _ in chunks)
    disk.close()
    assert not [t for t in threading.enumerate() if t.name == "ragblend-store-put" and t not in others]


# --- admission -----------------------------------------------------------------------------------------


def two_tiers(tmp_path, policy: str) -> TieredStore:
    return TieredStore([MemoryTier(1 << 20), DiskTier(tmp_path / "disk", 1 << 20)], codec="int8", fingerprint=FP,
                       admission=Admission(policy, window=100))


def test_second_sight_keeps_a_one_off_chunk_out_of_the_byte_tiers_until_it_is_seen_again(tmp_path):
    store = two_tiers(tmp_path, "second_sight")
    (once, kv1), (twice, kv2) = random_kv(0), random_kv(1)
    store.put_nowait(once, kv1)
    store.put_nowait(twice, kv2)
    store.flush()
    memory, disk = store.tiers
    assert memory.contains(once) and memory.contains(twice) and not disk.contains(once) and not disk.contains(twice)
    assert_same_kv(store.get(twice), kv2, "int8")  # the second sight: a hit in memory is written down
    store.flush()
    assert disk.contains(twice) and not disk.contains(once) and store.stats()["write_downs"] == 1
    memory.delete(twice)
    assert_same_kv(store.get(twice), kv2, "int8")  # now served by disk
    store.close()


def test_a_write_down_of_an_entry_evicted_meanwhile_is_skipped_quietly():
    gated, below = GatedMemory(), BytesTier(1 << 20)
    store = TieredStore([gated, below], codec="int8", fingerprint=FP, admission=Admission("second_sight"))
    (key, kv), (blocker, kv2) = random_kv(0), random_kv(1)
    gated.gate.set()
    store.put_nowait(key, kv)
    store.flush()
    gated.gate.clear()
    gated.entered.clear()
    store.put_nowait(blocker, kv2)  # the writer waits in this one
    assert gated.entered.wait(10)
    assert store.get(key) is not None  # the second sight: a write-down queued behind the blocker
    gated.delete(key)  # evicted before the writer gets to it
    gated.gate.set()
    store.flush()
    assert not below.contains(key) and store.stats()["put_errors"] == 0 and store.stats()["write_downs"] == 0
    store.close()


def test_a_chunk_put_again_after_memory_lost_it_is_admitted_below(tmp_path):
    store = two_tiers(tmp_path, "second_sight")
    key, kv = random_kv(0)
    store.put_nowait(key, kv)
    store.flush()
    store.tiers[0].delete(key)  # evicted before anyone read it
    store.put_nowait(key, kv)  # recomputed by the next request that needed it
    store.flush()
    assert store.tiers[1].contains(key)
    store.close()


def test_a_store_without_a_tensor_tier_keeps_first_sights_in_its_fastest_tier(tmp_path):
    store = TieredStore([DiskTier(tmp_path / "disk", 1 << 20), BytesTier(1 << 20)], codec="int8", fingerprint=FP,
                        admission=Admission("second_sight"))
    key, kv = random_kv(0)
    store.put_nowait(key, kv)
    store.flush()
    assert store.tiers[0].contains(key) and not store.tiers[1].contains(key)
    store.close()


def test_everywhere_admits_at_once_and_explicit_puts_are_always_admitted(tmp_path):
    everywhere, second = two_tiers(tmp_path / "a", "everywhere"), two_tiers(tmp_path / "b", "second_sight")
    (queued, kv), (uploaded, kv2) = random_kv(0), random_kv(1)
    everywhere.put_nowait(queued, kv)
    everywhere.flush()
    second.put(uploaded, kv2)  # an upload's precompute: useful by intent
    assert everywhere.tiers[1].contains(queued) and second.tiers[1].contains(uploaded)
    everywhere.close()
    second.close()


def test_a_leased_chunk_is_admitted_everywhere(tmp_path):
    ledger = open_metadata(f"sqlite:///{tmp_path / 'metadata.sqlite'}", tmp_path)
    settings = StoreSettings(codec="int8", memory_bytes=1 << 20, disk_bytes=1 << 20, read_threads=0,
                             admission="second_sight")
    store = build_store(settings, tmp_path / "kv", FP, ledger=ledger)
    (leased, kv), (pending, kv2) = random_kv(0), random_kv(1)
    store.put_nowait(leased, kv)
    store.flush()
    assert not store.tiers[1].contains(leased)
    store.put_nowait(pending, kv2)  # leased before its write runs, maybe
    result = store.lease([leased, pending], "client-1", ttl_s=300)
    assert set(result.leased) == {leased, pending} and not result.missing  # a pending chunk is found
    store.flush()
    assert store.tiers[1].contains(leased) and store.tiers[1].contains(pending)
    store.close()
    ledger.close()


def test_frequency_admits_first_sights_while_there_is_room_and_one_offs_never_evict_re_used_entries(tmp_path):
    keyed = [random_kv(i) for i in range(4)]
    entry_bytes = len(encode(keyed[0][1], "int8"))
    store = TieredStore([MemoryTier(1 << 20), DiskTier(tmp_path / "disk", 2 * entry_bytes)], codec="int8",
                        fingerprint=FP, admission=Admission("frequency", window=100))
    memory, disk = store.tiers
    (recurring, kv0), (one_off, kv1), (late, kv2), (later, kv3) = keyed
    for key, kv in ((recurring, kv0), (one_off, kv1)):
        store.put_nowait(key, kv)
    store.flush()
    assert disk.contains(recurring) and disk.contains(one_off)  # free room: first sights go down at once
    memory.delete(recurring)
    assert store.get_with_tier(recurring)[1] == "disk"  # re-used (a hit on disk)
    store.put_nowait(late, kv2)  # a first sight under pressure: its victim, the one-off, was never re-used
    store.flush()
    assert disk.contains(late) and not disk.contains(one_off) and disk.contains(recurring)
    store.get(late)  # now re-used too
    store.put_nowait(later, kv3)  # would evict a re-used entry: kept out of disk (memory has it)
    store.flush()
    assert not disk.contains(later) and memory.contains(later) and disk.contains(recurring) and disk.contains(late)
    store.close()


def test_sightings_count_within_a_window_of_recent_keys():
    seen = Sightings(window=2)
    assert [seen.sight("a"), seen.sight("a"), seen.sight("b"), seen.sight("c")] == [1, 2, 1, 1]
    assert seen.count("a") == 0 and seen.count("c") == 1  # "a" was the least recent past the window
    with pytest.raises(ValueError):
        Sightings(0)


def test_room_says_what_the_queue_takes_and_refusals_are_counted_by_the_bound(tmp_path):
    (first, kv), (second, kv2), (third, kv3) = random_kv(0), random_kv(1), random_kv(2)
    store, gated = gated_store(tmp_path, write_queue=8, write_queue_bytes=2 * kv.nbytes)
    assert store.put_room() == (8, 2 * kv.nbytes)
    assert store.put_nowait(first, kv) and gated.entered.wait(10)  # in flight, still pending: its bytes held
    assert store.put_room()[1] == kv.nbytes
    assert store.put_nowait(second, kv2) and store.put_room()[1] == 0
    assert not store.put_nowait(third, kv3)  # no bytes left: refused, not waited for
    stats = store.stats()
    assert stats["dropped_puts"] == 1 and stats["dropped_puts_by"] == {"entries": 0, "bytes": 1, "closed": 0}
    assert stats["dropped_put_bytes"] == kv3.nbytes
    assert (stats["put_queue_max"], stats["put_queue_max_bytes"]) == (8, 2 * kv.nbytes)
    gated.gate.set()
    store.flush()
    assert store.put_room() == (8, 2 * kv.nbytes)
    store.close()
    assert not store.writer.put_nowait(third, kv3) and store.stats()["dropped_puts_by"]["closed"] == 1
