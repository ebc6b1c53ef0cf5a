"""Prometheus metrics, vLLM-style names in the `ragblend:` namespace, on a registry of our own
(so several apps in one process, as in the tests, never collide)."""
from __future__ import annotations

from collections import Counter as CounterDict
from typing import Any, Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from app.engine.query import QueryStats
from app.tenants import current_tenant

# Seconds; CPU prefill of a few passages takes 0.1-10 s.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class _StoreCollector:
    """Per-tier hits, misses and dropped entries (corrupt: damaged; stale: an older format; both recomputed,
    never used) of the KV store, and its leases (store/leases.py), read from `store.stats()` at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, Any] | None]):
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        if not stats:
            return
        hits = CounterMetricFamily("ragblend:kv_store_hits", "Chunk KV lookups found in a store tier.",
                                   labels=["tier"])
        misses = CounterMetricFamily("ragblend:kv_store_misses", "Chunk KV lookups a store tier missed.",
                                     labels=["tier"])
        dropped = {kind: CounterMetricFamily(f"ragblend:kv_store_{kind}", f"Chunk KV entries a store tier dropped as "
                                                                     f"{why}: recomputed, never used.", labels=["tier"])
                   for kind, why in (("corrupt", "damaged"), ("stale", "of an older format"))}
        # What the loading controller (blend.ratio: auto) sees: mean read + check + decode rate of one layer.
        bandwidth = GaugeMetricFamily("ragblend:kv_tier_layer_bandwidth_bytes_per_second",
                                      "Per-layer KV read bandwidth of a store tier (mean over its layer reads).",
                                      labels=["tier"])
        for tier, counts in stats.get("tiers", {}).items():
            hits.add_metric([tier], counts.get("hits", 0))
            misses.add_metric([tier], counts.get("misses", 0))
            for kind, family in dropped.items():
                family.add_metric([tier], counts.get(kind, 0))
            if counts.get("layer_reads") and counts.get("layer_ms_mean"):
                per_layer = counts["layer_bytes"] / counts["layer_reads"]
                bandwidth.add_metric([tier], per_layer / (counts["layer_ms_mean"] / 1e3))
        yield hits
        yield misses
        yield from dropped.values()
        yield bandwidth
        yield from _writer_metrics(stats)
        if "leases" in stats:
            yield from _lease_metrics(stats["leases"], stats.get("tiers", {}))


def _writer_metrics(stats: dict[str, Any]) -> Iterator[Metric]:
    """The store's write queue (store/writer.py): what waits now, and the chunks it refused, by the bound that was
    full (entries, bytes, closed): the reason a repeated prompt finds less of itself stored."""
    refused = CounterMetricFamily("ragblend:kv_store_dropped_puts", "Chunks a request handed to the store's writer "
                                  "that it refused (its queue full in chunks or bytes, or closing): not stored.",
                                  labels=["bound"])
    for bound, count in stats.get("dropped_puts_by", {}).items():
        refused.add_metric([bound], count)
    yield refused
    yield CounterMetricFamily("ragblend:kv_store_dropped_put_bytes", "Bytes of the chunks the writer refused.",
                              value=stats.get("dropped_put_bytes", 0))
    yield GaugeMetricFamily("ragblend:kv_store_pending_bytes", "Bytes of chunks waiting for the store's writer.",
                            value=stats.get("pending_bytes", 0))


def _lease_metrics(leases: dict[str, Any], tiers: dict[str, dict[str, Any]]) -> Iterator[Metric]:
    """Running leases and families (every replica's), pinned bytes and caps per tier, evictions a lease held
    off per tier (the disk's: every process on it), this process's refusals per tier and expired holds."""
    yield GaugeMetricFamily("ragblend:kv_leases", "Running KV leases (family, entry pairs).", value=leases["leases"])
    yield GaugeMetricFamily("ragblend:kv_lease_families", "Families with a running KV lease.",
                            value=leases["families"])
    per_tier = {
        "pinned": (GaugeMetricFamily, "ragblend:kv_pinned_bytes", "Bytes running leases pin in a tier.",
                   leases["pinned_bytes"]),
        "cap": (GaugeMetricFamily, "ragblend:kv_pinned_cap_bytes", "The most bytes leases may pin in a tier.",
                leases["caps"]),
        "held": (CounterMetricFamily, "ragblend:kv_lease_held_evictions",
                 "LRU evictions that passed over a leased entry (the lease kept it).",
                 {name: tier["lease_held"] for name, tier in tiers.items() if tier.get("lease_held") is not None}),
        "refused": (CounterMetricFamily, "ragblend:kv_lease_refusals",
                    "Leases refused in a tier: its pinned cap would have been passed.",
                    {name: leases["refused"].get(name, 0) for name in leases["caps"]}),
    }
    for family_type, name, documentation, values in per_tier.values():
        family = family_type(name, documentation, labels=["tier"])
        for tier, value in sorted(values.items()):
            family.add_metric([tier], value)
        yield family
    yield CounterMetricFamily("ragblend:kv_leases_expired", "Lease holds (entry, tier) ended by expiry.",
                              value=leases["expired"])


class _DecodeStepCollector:
    """Batched decode steps by their number of rows (requests decoded together), and the seconds they took
    (their ratio is the step time at each batch size), from the scheduler."""

    def __init__(self, steps: Callable[[], dict[int, tuple[int, float]]]):
        self._steps = steps

    def collect(self) -> Iterator[Metric]:
        steps = CounterMetricFamily("ragblend:decode_steps", "Batched decode steps by rows decoded together.",
                                    labels=["rows"])
        seconds = CounterMetricFamily("ragblend:decode_step_seconds",
                                      "Seconds spent in batched decode steps, by rows decoded together.",
                                      labels=["rows"])
        for rows, (count, spent) in sorted(self._steps().items()):
            steps.add_metric([str(rows)], count)
            seconds.add_metric([str(rows)], spent)
        yield steps
        yield seconds


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, queue_depth: Callable[[], int], running: Callable[[], int],
                 store_stats: Callable[[], dict[str, Any] | None],
                 decode_steps: Callable[[], dict[int, tuple[int, float]]] = dict):
        self.registry = r = CollectorRegistry()
        self.tenant_chunks: dict[str, CounterDict[str]] = {}  # tenant -> chunk KVs by source (its /v1/cache)
        # tenant: a name from server.api_keys ("default" for the single key): bounded by the config
        self.requests = Counter("ragblend:http_requests", "HTTP requests by endpoint, status and tenant.",
                                ["endpoint", "status", "tenant"], registry=r)
        self.ttft = Histogram("ragblend:time_to_first_token_seconds", "Time to first token, queue included.",
                              ["mode"], buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("ragblend:e2e_request_latency_seconds", "End-to-end query latency, queue included.",
                             ["mode"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("ragblend:request_queue_time_seconds", "Time a job waited for its thread.",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("ragblend:prompt_tokens", "Prompt tokens of answered queries.", registry=r)
        self.cached_tokens = Counter("ragblend:prompt_tokens_cached",
                                     "Prompt tokens whose KV came from chunk caches.", registry=r)
        self.recomputed_tokens = Counter("ragblend:prompt_tokens_recomputed",
                                         "Cached prompt tokens recomputed by the blend.", registry=r)
        self.generation_tokens = Counter("ragblend:generation_tokens", "Generated tokens.", registry=r)
        self.chunks = Counter("ragblend:kv_chunks", 'Chunk KVs by where they came from ("computed": a miss).',
                              ["source"], registry=r)
        Gauge("ragblend:num_requests_waiting", "Queries waiting for a slot, uploads for the ingest lane.",
              registry=r).set_function(queue_depth)
        Gauge("ragblend:num_requests_running", "Queries in a slot on the model thread, plus a running upload.",
              registry=r).set_function(running)
        r.register(_StoreCollector(store_stats))
        r.register(_DecodeStepCollector(decode_steps))

    def observe_query(self, stats: QueryStats, queue_s: float) -> None:
        """One finished query; TTFT and latency count the queue wait, as a client sees them."""
        if stats.ttft_ms:
            self.ttft.labels(stats.mode).observe(queue_s + stats.ttft_ms / 1000)
        self.e2e.labels(stats.mode).observe(queue_s + stats.total_ms / 1000)
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.cached_tokens.inc(stats.cached_tokens)
        self.recomputed_tokens.inc(stats.recomputed_tokens)
        self.generation_tokens.inc(stats.completion_tokens)
        own = self.tenant_chunks.setdefault(current_tenant().name, CounterDict())
        for source, count in stats.store_hits.items():
            self.chunks.labels(source).inc(count)
            own[source] += count

    def observe_queue(self, seconds: float) -> None:
        self.queue_time.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
