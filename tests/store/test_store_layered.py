"""Per-layer reads: TieredStore.open -> LayeredEntry / ResidentEntry.layer(i) from every tier, damage,
promotion, threads, read-ahead."""
from __future__ import annotations

import pytest
import torch

from common.placement import HOST, Placement
from store import (
    CODECS,
    DiskTier,
    LayeredEntry,
    LayerReadError,
    MemoryTier,
    RedisTier,
    ResidentEntry,
    StoreClosedError,
    TieredStore,
    decode,
)
from store.serialize import OPEN_BYTES, parse_head
from tests.helpers import all_layers, assert_same_kv, random_kv, run_in_threads

FP = "model-a"
SHAPE = (9, 2, 13, 8)  # nine layers, so layer 7 is neither first nor last


def one_tier_store(tmp_path, redis_url, only: str, codec: str = "fp16", read_threads: int = 4) -> TieredStore:
    tier = {"memory": lambda: MemoryTier(1 << 24), "disk": lambda: DiskTier(tmp_path / "disk", 1 << 24),
            "redis": lambda: RedisTier(redis_url, timeout_s=2.0)}[only]()
    return TieredStore([tier], codec=codec, fingerprint=FP, read_threads=read_threads)


def flip_layer_byte(store: TieredStore, key: str, layer: int, redis_server=None) -> None:
    """Flip one byte inside `layer`'s section of the stored entry, in the disk file or Redis value."""
    tier = store.tiers[0]
    if tier.name == "disk":
        [path] = tier.root.rglob("*.val")
        data = bytearray(path.read_bytes())
    else:
        raw = redis_server.client()
        data = bytearray(raw.get("ragblend:" + key))
    offset, length = parse_head(bytes(data)).layer_range(layer)
    data[offset + length // 2] ^= 0x04
    if tier.name == "disk":
        path.write_bytes(bytes(data))
    else:
        raw.set("ragblend:" + key, bytes(data))
        raw.close()


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("only", ["memory", "disk", "redis"])
def test_every_layer_round_trips_from_every_tier(tmp_path, redis_url, codec, only):
    store = one_tier_store(tmp_path, redis_url, only, codec)
    key, kv = random_kv(1, shape=SHAPE, context=[3, 4])
    assert store.open(key) is None
    store.put(key, kv)
    store.flush()
    whole = store.get(key)
    with store.open(key) as entry:
        assert isinstance(entry, ResidentEntry if only == "memory" else LayeredEntry) and entry.tier == only
        assert (entry.codec, entry.shape, entry.num_layers, entry.position) == (codec, SHAPE, 9, 2)
        assert torch.equal(entry.token_ids, kv.token_ids) and entry.fingerprint == FP
        if only != "memory":
            assert entry.nbytes == len(store.tiers[0].get_bytes(key)) and entry.layer_nbytes * 9 < entry.nbytes
        else:  # one layer of the tensors held
            assert entry.layer_nbytes * 9 == entry.nbytes == kv.nbytes
        for i in (8, 0, 4, 1, 7, 2, 6, 3, 5):
            keys, values = entry.layer(i)
            assert keys.dtype == values.dtype == entry.dtype == whole.keys.dtype == kv.keys.dtype
            assert torch.equal(keys, whole.keys[i]) and torch.equal(values, whole.values[i])
        assert_same_kv(all_layers(entry), kv, codec)
        with pytest.raises(IndexError):
            entry.layer(9)
    stats = store.stats()["tiers"][only]
    assert stats["layer_reads"] == 18 and stats["layer_ms_mean"] > 0
    section = kv.nbytes // 9 if only == "memory" else parse_head(store.tiers[0].get_bytes(key)).layer_range(0)[1]
    assert stats["layer_bytes"] == 18 * section
    assert store.counts()[only].items() <= stats.items()  # the same counters, without asking the tiers
    store.close()


@pytest.mark.parametrize("read_threads", [0, 4])
@pytest.mark.parametrize("only", ["disk", "redis"])  # memory tensors never left the process: not re-checked
def test_a_damaged_layer_fails_alone_and_the_entry_becomes_a_miss(tmp_path, redis_url, redis_server, only,
                                                                   read_threads):
    store = one_tier_store(tmp_path / "a", redis_url, only, read_threads=read_threads)
    key, kv = random_kv(2, shape=SHAPE)
    other_key, other_kv = random_kv(3, shape=SHAPE)
    store.put(key, kv)
    store.flush()
    flip_layer_byte(store, key, 7, redis_server)
    store.put(other_key, other_kv)  # after the flip: the disk tier's only file was the damaged one
    store.flush()

    entry = store.open(key)  # the head is intact
    with pytest.raises(LayerReadError, match="layer 7") as caught:
        for i in range(8):  # read ahead, the damage may be found before layer 7 is asked for
            assert torch.equal(entry.layer(i)[0], kv.keys[i].half().float())
    assert caught.value.corrupt and (read_threads or i == 7)
    with pytest.raises(LayerReadError):
        entry.layer(8)  # the entry is done for
    entry.close()
    assert store.open(key) is None and store.get(key) is None and not store.contains(key)
    stats = store.stats()
    assert stats["corrupt"] == 1 and stats["tiers"][only]["corrupt"] == 1
    with store.open(other_key) as other:  # other entries are untouched
        assert_same_kv(all_layers(other), other_kv)
    assert_same_kv(store.get(other_key), other_kv)
    store.close()


@pytest.mark.parametrize("only", ["disk", "redis"])
def test_a_damaged_head_is_a_miss(tmp_path, redis_url, redis_server, only):
    store = one_tier_store(tmp_path, redis_url, only)
    key, kv = random_kv(5, shape=SHAPE)
    store.put(key, kv)
    store.flush()
    data = bytearray(store.tiers[0].get_bytes(key))
    head = parse_head(bytes(data))
    data[head.head_nbytes - 3] ^= 0x01  # inside the token ids: covered by the header digest
    if only == "disk":
        [path] = (tmp_path / "disk").rglob("*.val")
        path.write_bytes(bytes(data))
    else:
        with redis_server.client() as raw:
            raw.set("ragblend:" + key, bytes(data))
    assert store.open(key) is None and not store.contains(key)
    assert store.stats()["corrupt"] == 1
    store.close()


def test_redis_layers_are_range_reads(tmp_path, redis_url, redis_server):
    store = one_tier_store(tmp_path, redis_url, "redis", read_threads=0)  # no read-ahead: reads as asked
    key, kv = random_kv(6, shape=(9, 2, 200, 16))  # ~230 KB: far more than the first read
    store.put(key, kv)
    store.flush()
    with redis_server.client() as raw:
        raw.config_resetstat()
        with store.open(key) as entry:
            entry.layer(7)
            entry.layer(2)
        calls = {name: v["calls"] for name, v in raw.info("commandstats").items()}
    assert calls.get("cmdstat_getrange") == 3 and "cmdstat_get" not in calls  # the head, then two layers
    store.close()


def test_a_head_longer_than_the_first_read(tmp_path, redis_url):
    # 3000 token ids (24 KB) do not fit the first read: open reads the rest of the head.
    for only in ("disk", "redis"):
        store = one_tier_store(tmp_path / only, redis_url, only)
        key, kv = random_kv(7, shape=(2, 1, 3000, 2))
        assert 8 * 3000 > OPEN_BYTES
        store.put(key, kv)
        store.flush()
        with store.open(key) as entry:
            assert torch.equal(entry.token_ids, kv.token_ids)
            assert_same_kv(all_layers(entry), kv)
        store.close()


def test_an_entry_that_goes_away_mid_read_is_a_miss_not_damage(tmp_path, redis_url, redis_server):
    store = one_tier_store(tmp_path, redis_url, "redis", read_threads=0)  # layer 1 is read after the delete
    key, kv = random_kv(8, shape=(9, 2, 200, 16))
    store.put(key, kv)
    store.flush()
    entry = store.open(key)
    entry.layer(0)
    with redis_server.client() as raw:
        raw.delete("ragblend:" + key)  # evicted, expired or deleted by another replica
    with pytest.raises(LayerReadError, match="went away") as caught:
        entry.layer(1)
    assert not caught.value.corrupt and store.stats()["corrupt"] == 0
    entry.close()
    store.close()


def test_promotion_after_every_layer_was_read(tmp_path, redis_url):
    key, kv = random_kv(9, shape=SHAPE)
    with TieredStore([DiskTier(tmp_path / "w", 1 << 24), RedisTier(redis_url)], fingerprint=FP) as writer:
        writer.put(key, kv)
    store = TieredStore([MemoryTier(1 << 24), DiskTier(tmp_path / "r", 1 << 24), RedisTier(redis_url)],
                        fingerprint=FP)
    memory, disk, _ = store.tiers
    with store.open(key) as entry:  # closed with layers unread: not promoted
        assert entry.tier == "redis"
        entry.layer(0)
    assert not memory.contains(key) and not disk.contains(key)

    with store.open(key) as entry:
        for i in range(entry.num_layers):
            entry.layer(i)
        assert not memory.contains(key)  # not yet: on close
    assert memory.contains(key) and disk.contains(key)
    assert disk.get_bytes(key) == store.tiers[2].get_bytes(key)  # the very bytes, reassembled
    assert_same_kv(memory.held(key), decode(disk.get_bytes(key)), "native")  # the layers as read, held as tensors
    with store.open(key) as entry:
        assert entry.tier == "memory"
    store.close()


def test_layers_can_be_read_from_several_threads(tmp_path, redis_url):
    store = one_tier_store(tmp_path, redis_url, "disk", "int8")
    key, kv = random_kv(10, shape=SHAPE)
    store.put(key, kv)
    whole = store.get(key)
    with store.open(key) as entry:
        def read(start: int) -> None:
            for n in range(40):
                i = (start + n) % entry.num_layers
                keys, values = entry.layer(i)
                assert torch.equal(keys, whole.keys[i]) and torch.equal(values, whole.values[i])

        run_in_threads(read, 4)
    store.close()


def test_staging_is_pinned_as_the_placement_says(tmp_path):
    key, kv = random_kv(11, shape=SHAPE)
    placements = [HOST] + [Placement(torch.device("cuda"), on_host=False, pin=True)] * torch.cuda.is_available()
    for n, placement in enumerate(placements):
        store = TieredStore([DiskTier(tmp_path / str(n), 1 << 24)], codec="native", fingerprint=FP,
                            placement=placement)
        store.put(key, kv)
        with store.open(key) as entry:
            keys, values = entry.layer(0)  # native on the host: views of the staging buffer
            assert keys.is_pinned() == values.is_pinned() == placement.pin == entry.pin_memory
            assert torch.equal(keys, kv.keys[0])
        store.close()
        with pytest.raises(StoreClosedError):
            store.open(key)
