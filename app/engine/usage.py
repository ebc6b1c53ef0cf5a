"""Where retrieved chunks' KV came from: counted per query, reported by `ragblend store stats`.

Each retrieved chunk is served from a store tier (memory, disk, redis) or computed. The counts go
to the metadata database (retrieval.Metadata.record_usage): the one store every replica and the
CLI share, and one that keeps them (Redis may evict any key, and is optional; a tier's own
counters die with its process). The process's housekeeping thread (common/housekeeping.py) writes what piled up
every `interval_s`, and close() the rest, so a query never waits on the database for bookkeeping.

Entries a store tier dropped (corrupt: damaged; stale: an older format; both recomputed, never used)
are counted there too, from the store's in-process counters, under the sources "corrupt:<tier>" and
"stale:<tier>", so `ragblend store stats` shows them for every replica; they are not served chunks.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Any, Callable

from common.housekeeping import Housekeeping
from retrieval import Metadata

log = logging.getLogger("ragblend.usage")

COMPUTED = "computed"  # the source of a chunk whose KV was not in the store
DROPPED = ("corrupt", "stale")  # store entries dropped: "corrupt:<tier>", "stale:<tier>" in the served counts
FLUSH_INTERVAL_S = 1.0


class UsageLog:
    def __init__(self, metadata: Metadata, housekeeping: Housekeeping, interval_s: float = FLUSH_INTERVAL_S,
                 store_counts: Callable[[], dict[str, dict[str, Any]]] = dict) -> None:
        """`store_counts`: the store's per-tier counters (TieredStore.counts), for its dropped entries."""
        self.metadata, self.interval_s, self.store_counts = metadata, interval_s, store_counts
        self._lock = threading.Lock()
        self._dropped_seen: Counter[str] = Counter()  # of the store's cumulative counters, already written
        self._served: Counter[str] = Counter()
        self._per_key: dict[str, tuple[int, int, float]] = {}  # key -> (hits, computes, last use)
        self._flushing = housekeeping.every(interval_s, self.flush, "usage: flush")

    def record(self, key: str, source: str) -> None:
        """One retrieved chunk whose KV (under `key`) came from `source`: a tier name or COMPUTED."""
        computed = source == COMPUTED
        with self._lock:
            self._served[source] += 1
            hits, computes, _ = self._per_key.get(key, (0, 0, 0.0))
            self._per_key[key] = (hits + (not computed), computes + computed, time.time())

    def flush(self) -> None:
        """Write the counts gathered so far (they are dropped, with a warning, if the database fails)."""
        with self._lock:
            served, per_key = self._served, self._per_key
            self._served, self._per_key = Counter(), {}
            dropped = Counter({f"{kind}:{tier}": counts.get(kind, 0) for tier, counts in self.store_counts().items()
                               for kind in DROPPED})
            served += dropped - self._dropped_seen  # what was dropped since the last flush (positive counts only)
            self._dropped_seen = dropped
        if not served:
            return
        try:
            self.metadata.record_usage(served, per_key)
        except Exception as exc:  # statistics only: never worth failing or retrying a query for
            log.warning("could not record KV usage", extra={"chunks": sum(served.values()), "error": str(exc)})

    def close(self) -> None:
        self._flushing.cancel()
        self.flush()


def store_report(store_stats: dict[str, Any], usage: dict[str, Any]) -> dict[str, Any]:
    """`ragblend store stats`: where retrieved chunks' KV came from (every replica, from the
    metadata database), the hit rate, entries and bytes per tier (the memory tier is per
    process: each server's /metrics shows its own), and the running leases (every replica's)."""
    served = {source: n for source, n in usage["served"].items() if source.partition(":")[0] not in DROPPED}
    dropped = {kind: {} for kind in DROPPED}
    for source, n in usage["served"].items():
        kind, _, tier = source.partition(":")
        if kind in dropped:
            dropped[kind][tier] = n
    total = sum(served.values())
    from_kv = total - served.get(COMPUTED, 0)
    tiers = store_stats["tiers"]
    return {
        "retrieved_chunks": total,
        "hit_rate": round(from_kv / total, 4) if total else None,  # share served from KV, not computed
        "served": {source: {"chunks": n, "share": round(n / total, 4)} for source, n in served.items()},
        "dropped": dropped,  # entries found damaged (corrupt) or of an older format (stale), per tier: recomputed
        "bytes": {name: tier.get("bytes") for name, tier in tiers.items()},
        "tiers": {name: {k: tier.get(k) for k in ("entries", "bytes", "evictions", "lease_held", "maxmemory",
                                                  "policy") if k in tier} for name, tier in tiers.items()},
        "leases": {k: v for k, v in store_stats.get("leases", {}).items() if k != "by_family"},  # all replicas
        "codecs": store_stats.get("codecs"),
        "kv_entries_used": usage["entries_used"],
        "most_used": usage["top"],
    }
