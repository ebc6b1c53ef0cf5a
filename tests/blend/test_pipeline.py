"""Pipelined KV loading (blend.pipeline): same logits as loading first, loads overlap compute, a bad layer is a miss."""
from __future__ import annotations

import contextlib
import logging
import threading
import time

import pytest
import torch

from blend import Blender, ChunkKV, pipeline
from blend.pipeline import ChunkMiss
from store import BytesTier, DiskTier, MemoryTier, TieredStore, decode, encode, kv_key
from store.serialize import parse_head
from tests.blend.conftest import random_ids, tiny_model

HEAD, CHUNKS, SUFFIX = random_ids(7, 1), [random_ids(23, 2), random_ids(31, 3), random_ids(17, 4)], random_ids(9, 5)
CASES = [(0.0, "query"), (0.3, "query"), (0.3, "hkvd"), (0.3, "hybrid"), (1.0, "query")]


def stored_chunks(blender: Blender, store: TieredStore, chunks=CHUNKS) -> tuple[ChunkKV, list[str], list[ChunkKV]]:
    """(the head's KV, the chunks' store keys, the chunks' KV as the store returns them)."""
    head = blender.precompute(HEAD)
    keys, kvs = [], []
    for ids in chunks:
        kv = blender.precompute(ids, HEAD, context=head)
        key = kv_key(blender.fingerprint, kv.context_hash, kv.token_ids)
        store.put(key, kv)
        keys.append(key)
        kvs.append(decode(encode(kv, store.codec), verify_checksum=False))
    return head, keys, kvs


def run(blender: Blender, store: TieredStore, head: ChunkKV, keys: list[str], ratio: float, selection: str,
        pipeline: bool, **options):
    entries = [store.open(k) for k in keys]
    assert all(entries)
    return blender.prefill([head, *entries], SUFFIX, ratio, selection=selection, pipeline=pipeline, **options)


@pytest.fixture
def disk_store(tmp_path):
    with TieredStore([DiskTier(tmp_path / "kv", 1 << 26)]) as store:
        yield store


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_pipelined_prefill_gives_exactly_the_logits_of_loading_first(arch, disk_store):
    blender = Blender(tiny_model(arch, num_hidden_layers=6), tokenizer=None, fingerprint=f"tiny-{arch}", check_layer=2)
    head, keys, kvs = stored_chunks(blender, disk_store)
    for ratio, selection in CASES:
        whole = blender.prefill([head, *kvs], SUFFIX, ratio, selection=selection)   # today's path: ChunkKVs
        loaded = run(blender, disk_store, head, keys, ratio, selection, pipeline=False)
        piped = run(blender, disk_store, head, keys, ratio, selection, pipeline=True)
        assert piped.stats.pipelined and not loaded.stats.pipelined
        assert torch.equal(piped.logits, loaded.logits) and torch.equal(piped.logits, whole.logits), (ratio, selection)
        assert torch.equal(piped.selected, whole.selected)
        n = piped.num_tokens
        for layer in (0, 3, 5):
            assert torch.equal(piped.cache.layers[layer].keys[..., :n, :], whole.cache.layers[layer].keys[..., :n, :])
    assert disk_store.stats()["tiers"]["disk"]["layer_reads"] == 2 * len(CASES) * len(CHUNKS) * 6


def test_pipelined_prefill_on_smollm_matches(smollm):
    llm = smollm
    blender = Blender(llm.model, llm.tokenizer, llm.fingerprint)
    text = ["The river Thames flows through London and Oxford.", "Paris is the capital of France, on the Seine.",
            "Mount Everest is the highest mountain above sea level."]
    chunks = [llm.tokenizer(t * 3)["input_ids"] for t in text]
    with TieredStore([MemoryTier(1 << 28)]) as store:
        head, keys, kvs = stored_chunks(blender, store, chunks)
        for ratio in (0.0, 0.15):
            whole = blender.prefill([head, *kvs], SUFFIX, ratio)
            loaded = run(blender, store, head, keys, ratio, blender.selection, pipeline=False)
            piped = run(blender, store, head, keys, ratio, blender.selection, pipeline=True)
            assert torch.equal(piped.logits, loaded.logits) and torch.equal(piped.logits, whole.logits)


def test_on_the_host_only_a_source_that_reads_bytes_is_loaded_beside_the_prefill(disk_store, monkeypatch):
    """A loader thread hides a byte tier's reads; held tensors (the memory tier's, a ChunkKV) are copies on the same
    cores the prefill computes on: loaded first, a group of layers of every chunk at once, the same logits."""
    blender = Blender(tiny_model("llama", num_hidden_layers=4), tokenizer=None, fingerprint="tiny", check_layer=1)
    with TieredStore([MemoryTier(1 << 26)]) as memory:
        head, keys, kvs = stored_chunks(blender, memory)
        held = run(blender, memory, head, keys, 0.3, "query", pipeline=True)
        monkeypatch.setattr(pipeline, "HELD_GROUP_BYTES", 1)  # a layer at a time
        layer_by_layer = run(blender, memory, head, keys, 0.3, "query", pipeline=True)
    head, keys, _ = stored_chunks(blender, disk_store)
    read = run(blender, disk_store, head, keys, 0.3, "query", pipeline=True)
    assert read.stats.pipelined and not held.stats.pipelined
    assert torch.equal(read.logits, held.logits) and torch.equal(read.logits, layer_by_layer.logits)
    n = read.num_tokens
    for layer in range(4):
        assert torch.equal(held.cache.layers[layer].keys[..., :n, :], read.cache.layers[layer].keys[..., :n, :])


class SlowTier(BytesTier):
    """An in-process byte tier whose every range read takes `delay_s` more: a remote store, for timing structure."""

    name = "slow"

    def __init__(self, delay_s: float):
        super().__init__(1 << 26)
        self.delay_s = delay_s

    def reader(self, key):
        inner = super().reader(key)
        if inner is None:
            return None
        delay = self.delay_s

        class Slow:
            def read(self, offset, length):
                time.sleep(delay)
                return inner.read(offset, length)

            def close(self):
                inner.close()

        return Slow()


def timed_layers(blender: Blender, delay_s: float, events: list) -> list:
    """Each decoder layer sleeps `delay_s` (compute standing in for a bigger model); events record it."""
    handles = []
    for i, layer in enumerate(blender.decoder.layers):
        def before(module, args, kwargs, i=i):
            module._started = time.perf_counter()
            time.sleep(delay_s)

        def after(module, args, kwargs, output, i=i):
            events.append(("compute", i, module._started, time.perf_counter()))

        handles.append(layer.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(layer.register_forward_hook(after, with_kwargs=True))
    return handles


@contextlib.contextmanager
def loads_logged(events: list):
    """The loader's "kv layer loaded" debug records, as ("load", layer, start_s, end_s) in `events`."""
    class Collect(logging.Handler):
        def emit(self, record):
            if record.getMessage() == "kv layer loaded":
                events.append(("load", record.layer, record.start_s, record.end_s))

    logger, handler = logging.getLogger("ragblend.blend"), Collect(logging.DEBUG)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.mark.parametrize("pipeline", [True, False])
def test_a_slow_tier_is_overlapped_with_compute(pipeline):
    layers, delay = 8, 0.025
    blender = Blender(tiny_model("llama", num_hidden_layers=layers), tokenizer=None, fingerprint="tiny-llama")
    store = TieredStore([SlowTier(delay)], read_threads=0)  # the loader's own overlap, no read-ahead pool
    head, keys, _ = stored_chunks(blender, store, CHUNKS[:2])  # two chunks: a layer loads in ~2 * delay
    run(blender, store, head, keys, 0.0, "query", pipeline=pipeline)  # warm-up (first-call costs)
    events: list = []
    handles = timed_layers(blender, 2 * delay, events)
    try:
        with loads_logged(events):
            run(blender, store, head, keys, 0.0, "query", pipeline=pipeline)
    finally:
        for h in handles:
            h.remove()
    load = {i: (s, e) for kind, i, s, e in events if kind == "load"}
    compute = {i: (s, e) for kind, i, s, e in events if kind == "compute"}
    assert sorted(load) == sorted(compute) == list(range(layers))  # ratio 0: every layer runs once
    overlapped = sum(load[i + 1][0] < compute[i][1] for i in range(layers - 1))
    if pipeline:  # the order shows the overlap (the seconds saved are bench/pipeline.py's)
        assert overlapped >= layers - 2, events  # layer i+1 was on its way while layer i computed
    else:
        assert max(e for _, e in load.values()) <= min(s for s, _ in compute.values())  # every layer first


@pytest.mark.parametrize("pipeline", [True, False])
def test_a_corrupt_layer_is_a_miss_recomputed_with_correct_logits(disk_store, pipeline):
    blender = Blender(tiny_model("llama", num_hidden_layers=6), tokenizer=None, fingerprint="tiny-llama")
    head, keys, kvs = stored_chunks(blender, disk_store)
    reference = blender.prefill([head, *kvs], SUFFIX, 0.3)
    path = disk_store.tiers[0]._cache.peek_file(keys[1])
    data = bytearray(open(path, "rb").read())
    offset, length = parse_head(bytes(data)).layer_range(4)
    data[offset + length // 2] ^= 0x10
    open(path, "wb").write(bytes(data))

    asked = []

    def recompute(index: int) -> ChunkKV:
        asked.append(index)
        return kvs[index - 1]  # what recomputing the chunk gives (its stored form); index 0 is the head

    result = run(blender, disk_store, head, keys, 0.3, "query", pipeline=pipeline, recompute=recompute)
    assert asked == [2] and result.stats.reloaded_chunks == 1
    assert torch.equal(result.logits, reference.logits)
    assert disk_store.open(keys[1]) is None and disk_store.stats()["corrupt"] == 1


def test_a_corrupt_layer_without_recompute_raises_chunk_miss(disk_store):
    blender = Blender(tiny_model("llama", num_hidden_layers=4), tokenizer=None, fingerprint="tiny-llama")
    head, keys, _ = stored_chunks(blender, disk_store)
    path = disk_store.tiers[0]._cache.peek_file(keys[0])
    data = bytearray(open(path, "rb").read())
    offset, length = parse_head(bytes(data)).layer_range(3)
    data[offset + length // 2] ^= 0x10
    open(path, "wb").write(bytes(data))
    with pytest.raises(ChunkMiss) as caught:
        run(blender, disk_store, head, keys, 0.3, "query", pipeline=True)
    assert caught.value.index == 1 and "layer 3" in str(caught.value)


def test_an_abandoned_prefill_stops_its_loader_and_closes_entries():
    blender = Blender(tiny_model("llama", num_hidden_layers=6), tokenizer=None, fingerprint="tiny-llama")
    store = TieredStore([SlowTier(0.01)])
    head, keys, _ = stored_chunks(blender, store)
    entries = [store.open(k) for k in keys]
    steps = blender.prefill_steps([head, *entries], SUFFIX, 0.3, pipeline=True)
    next(steps)
    next(steps)
    steps.close()  # a cancelled request
    assert not [t for t in threading.enumerate() if t.name == "ragblend-kv-loader"]
    with pytest.raises(Exception, match="closed"):
        entries[0].layer(0)
