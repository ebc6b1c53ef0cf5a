"""The loading controller as a request runs it (app.engine.loading.LoadingControl) over a real store: per chunk, load
or recompute from the rates it was given, the cheapest of the tiers holding a chunk, and rates learnt from
real reads."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from app.engine.loading import LoadingControl
from blend import Blender, ChunkKV
from blend.pipeline import LayerSource
from store import CacheGenTables, DiskTier, MemoryTier, RedisTier, TieredStore, kv_key, register_tables
from store.codecs import DEFAULT_BINS
from tests.blend.conftest import random_ids, tiny_model

HEAD, CHUNKS = random_ids(7, 1), [random_ids(40, 2), random_ids(40, 3)]
LAYERS = 4


@dataclass
class Piece:
    ids: list[int]
    tier: str | None
    kv: ChunkKV | LayerSource | None


@pytest.fixture
def setup(tmp_path, redis_url):
    """(blender, store: memory native, disk int4, Redis cachegen, the chunks' keys, their computed KV)."""
    blender = Blender(tiny_model("llama", num_hidden_layers=LAYERS), tokenizer=None, fingerprint="tiny-llama")
    head = blender.precompute(HEAD)
    kvs = [blender.precompute(ids, HEAD, context=head) for ids in CHUNKS]
    cachegen = register_tables(CacheGenTables.fit(kvs, DEFAULT_BINS))
    redis = RedisTier(redis_url, timeout_s=5.0)
    store = TieredStore([MemoryTier(1 << 24), DiskTier(tmp_path / "kv", 1 << 24), redis],
                        codec={"memory": "native", "disk": "int4", "redis": cachegen}, fingerprint="tiny-llama")
    keys = [kv_key(kv.fingerprint, kv.context_hash, kv.token_ids) for kv in kvs]
    for key, kv in zip(keys, kvs):
        store.put(key, kv)
        store.tiers[0].delete(key)  # on disk and in Redis only
    store.flush()
    yield blender, store, keys, kvs
    store.close()


def run(control: LoadingControl, pieces: list[Piece]) -> tuple[float, dict, list[int]]:
    """The controller's ratio and decision for `pieces`, and which pieces it recomputed."""
    recomputed = []

    def recompute(piece: Piece) -> str:
        recomputed.append(pieces.index(piece))
        return "recomputed"  # what recomputing gives is not the controller's business
    steps = control.ratio(pieces, suffix_tokens=8, selection="query", recompute=recompute)
    try:
        while True:
            next(steps)
    except StopIteration as done:
        ratio, decision = done.value
    return ratio, decision, recomputed


def opened(store: TieredStore, keys: list[str], kvs: list[ChunkKV]) -> list[Piece]:
    """The chunks as the engine's plan holds them: opened from the first tier that has them."""
    return [Piece(kv.token_ids.tolist(), entry.tier, entry) for kv, entry in zip(kvs, map(store.open, keys))]


def test_recomputes_when_the_measured_link_is_slower_than_recompute_and_loads_when_faster(setup):
    blender, store, keys, kvs = setup
    control = LoadingControl(blender, store, floor=0.15)
    ratio, decision, _ = run(control, opened(store, keys, kvs))
    assert ratio == 0.15 and decision["reason"].startswith("not calibrated")
    control.calibration.observe_compute(40 * LAYERS, 40 * LAYERS * 1e-4)  # 100 µs a token-layer: 4 ms a chunk's layer
    control.calibration.observe_tier("disk", 1000, 1.0)                  # 1 kB/s: seconds a layer
    pieces = opened(store, keys, kvs)
    assert [p.tier for p in pieces] == ["disk", "disk"]
    _, decision, recomputed = run(control, pieces)
    assert recomputed == [0, 1] and decision["recompute_from_text"] == [0, 1]
    control.calibration.alpha = 1.0
    control.calibration.observe_tier("disk", 1e9, 1.0)                   # 1 GB/s: microseconds
    pieces = opened(store, keys, kvs)
    _, decision, recomputed = run(control, pieces)
    assert recomputed == [] and decision["load_from"] == ["disk", "disk"]
    assert all(p.kv.tier == "disk" for p in pieces)


def test_of_the_tiers_holding_a_chunk_the_cheapest_is_read(setup):
    blender, store, keys, kvs = setup
    control = LoadingControl(blender, store, floor=0.15)
    cal = control.calibration
    cal.observe_compute(40 * LAYERS, 40 * LAYERS * 1e-2)    # a slow model: 0.4 s a chunk's layer, loading wins
    cal.observe_tier("disk", 1e4, 1.0)                      # a slow disk: 10 kB/s
    cal.observe_tier("redis", 1e9, 1.0)                     # a fast link
    cal.observe_codec("cachegen", 1e8, 1e6, 1.0)            # 100 MB/s decode, 100 B a token-layer
    pieces = opened(store, keys, kvs)
    assert [p.tier for p in pieces] == ["disk", "disk"]     # the walk finds disk first
    _, decision, recomputed = run(control, pieces)
    assert recomputed == [] and decision["load_from"] == ["redis", "redis"]
    assert [(p.tier, p.kv.tier, p.kv.codec) for p in pieces] == [("redis", "redis", "cachegen")] * 2
    assert pieces[0].kv.layer(0)[0].shape[1] == 40          # and it reads


def test_rates_are_learnt_from_real_reads(setup):
    blender, store, keys, kvs = setup
    control = LoadingControl(blender, store, floor=0.15)
    for tier in ("disk", "redis"):
        with store.open(keys[0], tier=tier) as entry:
            for i in range(entry.num_layers):
                entry.layer(i)
    control.observe(100, 0.01)
    cal = control.calibration
    assert cal.bandwidth["disk"] > 0 and cal.bandwidth["redis"] > 0
    assert cal.decode_rate["int4"] > 0 and cal.decode_rate["cachegen"] > 0
    assert cal.estimate("redis", "cachegen", 40).layer_bytes < cal.estimate("disk", "int4", 40).layer_bytes
    snapshot = cal.snapshot()
    assert set(snapshot["codec_decode_mb_s"]) == {"int4", "cachegen"}
    assert snapshot["recompute_us_per_token_layer"] == pytest.approx(100)
