"""Admission benchmark: hit rates of recurring passages under a stream with many one-off prompts, per policy.

    python bench/admission.py [--requests 400] [--recurring 60] [--passages 5] [--one-offs 0,2,5,10] [--seed 0]

A real TieredStore (memory tier, disk tier under a temp dir), its chunks random KV of one shape. Each request
brings `--passages` passages drawn (Zipf-like, s=0.8) from a pool of `--recurring` passages, plus N one-off
chunks (a pasted document, a long question: never seen again). Each chunk is looked up (get); a miss is
computed and handed over with put_nowait, as a request stores its prompt. The memory tier holds a fifth of the
recurring pool, the disk tier half of it: one-offs compete with the pool for the lower tier. Per policy
(store.admission: everywhere, second_sight, frequency) and N: `recurring_hit_rate` (lookups of a recurring
passage seen before that hit any tier), per tier its hits, and the bytes written to disk (what one-offs cost
the disk).
Prints JSON on stdout, progress on stderr.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from store import DiskTier, MemoryTier, TieredStore, encode  # noqa: E402
from store.admission import Admission  # noqa: E402
from tests.helpers import random_kv  # noqa: E402

SHAPE = (4, 3, 64, 8)  # [L, H, T, D]: small; the policy does not care about the shape


def log(msg: str) -> None:
    print(f"[bench/admission] {msg}", file=sys.stderr, flush=True)


def stream(requests: int, recurring: int, passages: int, one_offs: int, seed: int) -> list[list[tuple[int, bool]]]:
    """Per request its chunks as (seed of the chunk's KV, recurring?); the same stream for every policy."""
    rng = random.Random(seed)
    weights = [1 / (rank + 1) ** 0.8 for rank in range(recurring)]
    next_one_off = recurring
    out = []
    for _ in range(requests):
        chunks = [(i, True) for i in dict.fromkeys(rng.choices(range(recurring), weights, k=passages))]
        chunks += [(next_one_off + j, False) for j in range(one_offs)]
        next_one_off += one_offs
        rng.shuffle(chunks)
        out.append(chunks)
    return out


def run_policy(policy: str, requests: list[list[tuple[int, bool]]], recurring: int, root: Path) -> dict:
    kv_bytes, entry_bytes = random_kv(0, SHAPE)[1].nbytes, len(encode(random_kv(0, SHAPE)[1], "int8"))
    memory, disk = MemoryTier(kv_bytes * recurring // 5), DiskTier(root / policy, entry_bytes * recurring // 2)
    store = TieredStore([memory, disk], codec="int8", fingerprint="model-a", read_threads=0,
                        admission=Admission(policy))
    seen: set[int] = set()
    hits = lookups = 0
    by_tier = {"memory": 0, "disk": 0}
    for chunks in requests:
        for seed, recurs in chunks:
            key, kv = random_kv(seed, SHAPE)
            _, tier = store.get_with_tier(key)
            if recurs and seed in seen:
                lookups += 1
                hits += tier is not None
                if tier is not None:
                    by_tier[tier] += 1
            if tier is None:
                store.put_nowait(key, kv)
            seen.add(seed)
        store.flush()  # a request's storing is done before the next arrives (the steady state)
    disk_stats = store.stats()["tiers"]["disk"]
    store.close()
    return {"recurring_hit_rate": round(hits / max(lookups, 1), 4), "recurring_lookups": lookups,
            "hits_by_tier": by_tier, "disk_evictions": disk_stats["evictions"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--recurring", type=int, default=60)
    parser.add_argument("--passages", type=int, default=5)
    parser.add_argument("--one-offs", default="0,2,5,10", help="one-off chunks per request, comma-separated")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(x) for x in args.one_offs.split(",")]:
            requests = stream(args.requests, args.recurring, args.passages, n, args.seed)
            for policy in ("everywhere", "second_sight", "frequency"):
                log(f"one-offs {n}: {policy}")
                results.append({"one_offs": n, "policy": policy,
                                **run_policy(policy, requests, args.recurring, Path(tmp) / f"{n}")})
    print(json.dumps({"bench": "admission", "requests": args.requests, "recurring": args.recurring,
                      "passages": args.passages, "results": results}, indent=2))


if __name__ == "__main__":
    main()
