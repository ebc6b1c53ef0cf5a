"""Where retrieved chunks' KV came from: counted per query, reported by `ragblend store stats`.

Each retrieved chunk is served from a store tier (memory, disk, redis) or computed. The counts go
to the metadata database (retrieval.Metadata.record_usage): the one store every replica and the
CLI share, and one that keeps them (Redis may evict any key, and is optional; a tier's own
counters die with its process). A background thread writes what piled up every `interval_s`
and at close, so a query never waits on the database for bookkeeping.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Any

from retrieval import Metadata

log = logging.getLogger("ragblend.usage")

COMPUTED = "computed"  # the source of a chunk whose KV was not in the store
FLUSH_INTERVAL_S = 1.0


class UsageLog:
    def __init__(self, metadata: Metadata, interval_s: float = FLUSH_INTERVAL_S) -> None:
        self.metadata, self.interval_s = metadata, interval_s
        self._lock = threading.Lock()
        self._served: Counter[str] = Counter()
        self._per_key: dict[str, tuple[int, int, float]] = {}  # key -> (hits, computes, last use)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ragblend-usage", daemon=True)
        self._thread.start()

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
        if not served:
            return
        try:
            self.metadata.record_usage(served, per_key)
        except Exception as exc:  # statistics only: never worth failing or retrying a query for
            log.warning("could not record KV usage", extra={"chunks": sum(served.values()), "error": str(exc)})

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.flush()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.flush()


def store_report(store_stats: dict[str, Any], usage: dict[str, Any]) -> dict[str, Any]:
    """`ragblend store stats`: where retrieved chunks' KV came from (every replica, from the
    metadata database), the hit rate, and entries and bytes per tier (the memory tier is per
    process: each server's /metrics shows its own)."""
    served: dict[str, int] = usage["served"]
    total = sum(served.values())
    from_kv = total - served.get(COMPUTED, 0)
    tiers = store_stats["tiers"]
    return {
        "retrieved_chunks": total,
        "hit_rate": round(from_kv / total, 4) if total else None,  # share served from KV, not computed
        "served": {source: {"chunks": n, "share": round(n / total, 4)} for source, n in served.items()},
        "bytes": {name: tier.get("bytes") for name, tier in tiers.items()},
        "tiers": {name: {k: tier.get(k) for k in ("entries", "bytes", "evictions", "maxmemory", "policy")
                         if k in tier} for name, tier in tiers.items()},
        "codec": store_stats.get("codec"),
        "kv_entries_used": usage["entries_used"],
        "most_used": usage["top"],
    }
