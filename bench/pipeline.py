"""TTFT with the chunks' KV in memory, on disk, in Redis and in a 100 MB/s tier, pipelined vs not.

One run on MuSiQue passages (default 5, ~3k tokens) with SmolLM2 prints JSON:
    {"prompt_tokens", "kv_mb", "ratio", "ttft_s": {tier: {"pipelined", "whole", "auto"}},
     "vs_memory": {tier: {...}}, "load_wait_ms": {...}, "controller": {tier: its last plan}, "commit", ...}
Each tier is a TieredStore holding only that tier, every passage's KV stored in it beforehand (as
ingest does). TTFT = open the stored entries + blended prefill (blend.ratio, default 0.15) + the first
token. "whole": every layer of every chunk is read before the prefill starts (today's loading);
"pipelined": a loader thread reads layer i+1 while layer i computes (blend.pipeline). "limited" is a
benchmark-only memory tier whose reads are throttled to --bandwidth MB/s (a remote store stand-in).
"auto": pipelined, with the loading controller (blend.controller, as blend.ratio: auto) choosing the
ratio (>= --ratio) and which chunks to recompute from text, from costs measured during the run.
vs_memory = TTFT / the memory tier's pipelined TTFT; medians over interleaved repeats.
Starts its own redis-server (tests.servers.RedisServer) when --tiers names redis.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from app.cachegen import tier_codecs  # noqa: E402
from app.components import Components  # noqa: E402
from app.config import load_settings  # noqa: E402
from blend.controller import Calibration, ChunkCost, Source, overlap_share, plan_loading  # noqa: E402
from blend.selection import get_policy  # noqa: E402
from common import git_commit  # noqa: E402
from store import BytesTier, DiskTier, MemoryTier, RedisTier, TieredStore  # noqa: E402
from tests.servers import RedisServer  # noqa: E402

HOW = ("pipelined", "whole", "auto")


class LimitedTier(BytesTier):
    """An in-process byte tier whose range reads take at least nbytes / bandwidth (sleeping the rest): a remote
    store at a set bandwidth. Benchmark-only."""

    name = "limited"
    trusted = False  # bytes from "elsewhere": checked, as a real remote tier's are

    def __init__(self, bandwidth_bps: float):
        super().__init__(1 << 32)
        self.bandwidth = bandwidth_bps

    def reader(self, key):
        inner = super().reader(key)
        if inner is None:
            return None
        bandwidth = self.bandwidth

        class Throttled:
            def read(self, offset, length):
                start = time.perf_counter()
                data = inner.read(offset, length)
                time.sleep(max(0.0, len(data) / bandwidth - (time.perf_counter() - start)))
                return data

            def close(self):
                inner.close()

        return Throttled()


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", type=Path, default=REPO.parent / "shared/data/musique_dev.json")
    parser.add_argument("--question", type=int, default=0)
    parser.add_argument("--passages", type=int, default=5)
    parser.add_argument("--ratio", type=float, default=0.15)
    parser.add_argument("--selection", default=None, help="a blend.selection policy (default: blend.selection)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bandwidth", type=float, default=100.0, help="MB/s of the limited tier")
    parser.add_argument("--tiers", default="memory,disk,redis,limited")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    item = json.loads(args.dataset.read_text())[args.question]
    load_before = os.getloadavg()

    names = args.tiers.split(",")
    with tempfile.TemporaryDirectory() as tmp, (RedisServer() if "redis" in names else contextlib.nullcontext()
                                                 ) as redis_server:
        settings = load_settings(data_dir=tmp, model={"cache_dir": str(REPO / "data/models")},
                                 store={"memory_bytes": 0, "disk_bytes": 0})
        parts = Components(settings)
        blender, kv_cache = parts.blender, parts.kv_cache
        head = kv_cache.head()
        suffix = kv_cache.prompt.suffix_ids(item["question"])
        passages = [kv_cache.prompt.text_passage_ids(c["text"], c["title"]) for c in item["ctxs"][:args.passages]]
        log(f"precomputing {len(passages)} passages")
        kvs = [kv_cache.blender.precompute(ids, kv_cache.context_ids, context=head) for ids in passages]
        keys = [kv_cache.key(ids) for ids in passages]
        make = {"memory": lambda: MemoryTier(1 << 32), "disk": lambda: DiskTier(Path(tmp) / "disk", 1 << 32),
                "redis": lambda: RedisTier(redis_server.url, timeout_s=10.0),
                "limited": lambda: LimitedTier(args.bandwidth * 1e6)}
        tier_of = {name: {"limited": "redis"}.get(name, name) for name in names}  # limited: a remote store
        codecs = tier_codecs(settings.store, Path(tmp), blender, kv_cache.prompt, tiers=tier_of.values())
        stores = {name: TieredStore([make[name]()], codec=codecs[tier_of[name]],
                                    fingerprint=blender.fingerprint,
                                    placement=blender.backend.placement) for name in names}
        for store in stores.values():
            for key, kv in zip(keys, kvs):
                store.put(key, kv)
            store.flush()
        prompt_tokens = head.num_tokens + sum(map(len, passages)) + len(suffix)
        with contextlib.ExitStack() as opened:
            kv_bytes = sum(opened.enter_context(stores[names[0]].open(k)).nbytes for k in keys)

        calibration, plans = Calibration(), {}
        policy = get_policy(args.selection or blender.selection)
        layers = policy.layer_range(blender.num_layers)

        def ttft(tier: str, how: str) -> tuple[float, float]:
            store = stores[tier]
            start = time.perf_counter()
            segments, ratio = [head, *(store.open(k) for k in keys)], args.ratio
            if how == "auto" and (rates := calibration.rates()) is not None:
                plan = plan_loading([ChunkCost(len(e.token_ids), (Source(tier, e.codec, e.layer_nbytes),))
                                     for e in segments[1:]], rates, floor=args.ratio, suffix_tokens=len(suffix),
                                    overlap=overlap_share(policy.question_layers and layers, blender.num_layers))
                for i, load in enumerate(plan.load):
                    if not load:  # recompute from text instead (what ChunkKVCache.compute does)
                        segments[i + 1].close()
                        segments[i + 1] = blender.precompute(passages[i], kv_cache.context_ids, context=head)
                ratio, plans[tier] = plan.ratio, plan.as_dict()
            compute_start = time.perf_counter()
            prefill = blender.prefill(segments, suffix, ratio, pipeline=how != "whole", selection=args.selection)
            int(prefill.logits.argmax())
            end = time.perf_counter()
            if how != "whole":  # live costs, as the engine keeps them
                through = (prefill.stats.recomputed_tokens + len(suffix)) * blender.num_layers
                calibration.observe_compute(through, end - compute_start - prefill.stats.load_wait_ms / 1e3)
                calibration.observe_reads(store.counts(), store.decode_counts())
            return end - start, prefill.stats.load_wait_ms

        for tier in stores:  # warm-up, and the controller's first measurements
            ttft(tier, "pipelined")
        runs = [(t, how) for t in stores for how in HOW]
        times: dict = {run: [] for run in runs}
        waits: dict = {run: [] for run in runs}
        for r in range(args.repeats):
            for run in runs:  # interleaved, so noise hits every case alike
                seconds, wait_ms = ttft(*run)
                times[run].append(seconds)
                waits[run].append(wait_ms)
                log(f"repeat {r + 1}/{args.repeats} {run[0]:>7} {run[1]:>9}: "
                    f"{seconds:.3f}s (waited {wait_ms:.0f} ms for layers)")
        for store in stores.values():
            store.close()
        parts.close()

    median = {run: statistics.median(t) for run, t in times.items()}
    memory = median.get(("memory", "pipelined"))
    print(json.dumps({
        "passages": len(passages), "prompt_tokens": prompt_tokens, "kv_mb": round(kv_bytes / 1e6, 1),
        "codecs": settings.store.codecs(), "ratio": args.ratio, "selection": args.selection or settings.blend.selection,
        "bandwidth_mb_s": args.bandwidth,
        "repeats": args.repeats,
        "ttft_s": {t: {how: round(median[(t, how)], 4) for how in HOW} for t in stores},
        "vs_memory": None if memory is None else
        {t: {how: round(median[(t, how)] / memory, 3) for how in HOW} for t in stores},
        "load_wait_ms": {t: {how: round(statistics.median(waits[(t, how)]), 1) for how in HOW} for t in stores},
        "controller": plans, "calibration": calibration.snapshot(),
        "threads": torch.get_num_threads(), "commit": git_commit(),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }, indent=2))


if __name__ == "__main__":
    main()
