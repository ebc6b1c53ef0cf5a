"""This process's store counters: lookups per tier and in total, cheap to read on a hot path (no tier asked)."""
from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass
class TierCounts:
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    stale: int = 0
    load_s_total: float = 0.0
    load_s_last: float | None = None
    layer_reads: int = 0
    layer_bytes: int = 0
    layer_s_total: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        mean = self.load_s_total / self.hits * 1e3 if self.hits else None
        last = None if self.load_s_last is None else self.load_s_last * 1e3
        layer_mean = self.layer_s_total / self.layer_reads * 1e3 if self.layer_reads else None
        return {"hits": self.hits, "misses": self.misses, "corrupt": self.corrupt, "stale": self.stale,
                "load_ms_mean": mean, "load_ms_last": last, "layer_reads": self.layer_reads,
                "layer_bytes": self.layer_bytes, "layer_ms_mean": layer_mean, "layer_s_total": self.layer_s_total}


@dataclass
class CodecCounts:
    layers: int = 0
    bytes: int = 0
    token_layers: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"layers": self.layers, "bytes": self.bytes, "token_layers": self.token_layers,
                "decode_ms_mean": self.seconds / self.layers * 1e3 if self.layers else None,
                "decode_s_total": self.seconds}


class StoreCounters:
    """Totals (gets, hits, misses, puts, corrupt, stale; of the background writes: pending_hits, queued_puts,
    dropped_puts, write_downs, write_s_total) and per tier its TierCounts. Thread-safe."""

    def __init__(self, tier_names: Iterable[str]) -> None:
        self._lock = threading.Lock()
        self._tiers = {name: TierCounts() for name in tier_names}
        self._codecs: dict[str, CodecCounts] = {}
        self._totals: dict[str, Any] = dict.fromkeys(("gets", "hits", "misses", "puts", "corrupt", "stale",
                                                      "pending_hits", "queued_puts", "dropped_puts", "write_downs"), 0)
        self._totals["write_s_total"] = 0.0

    def bump(self, total: str) -> None:
        with self._lock:
            self._totals[total] += 1

    def add_write_s(self, seconds: float) -> None:
        """A background write's time (encoding and tier writes, off the caller's thread)."""
        with self._lock:
            self._totals["write_s_total"] += seconds

    def looked_up(self, tier: str, load_s: float | None) -> None:
        """A hit in `tier` that took `load_s` seconds (read + check + decode, or the head for an open),
        or a miss there (None)."""
        with self._lock:
            c = self._tiers[tier]
            if load_s is None:
                c.misses += 1
                return
            c.hits += 1
            c.load_s_total += load_s
            c.load_s_last = load_s

    def dropped(self, tier: str, stale: bool) -> None:
        """A bad entry dropped from `tier`: of another format version (`stale`) or damaged (corrupt)."""
        kind = "stale" if stale else "corrupt"
        with self._lock:
            setattr(self._tiers[tier], kind, getattr(self._tiers[tier], kind) + 1)
            self._totals[kind] += 1

    def layer_read(self, tier: str, nbytes: int, seconds: float) -> None:
        """One layer read (and checked) through an open entry: the tier's bandwidth, for a loader."""
        with self._lock:
            c = self._tiers[tier]
            c.layer_reads += 1
            c.layer_bytes += nbytes
            c.layer_s_total += seconds

    def layer_decoded(self, codec: str, nbytes: int, tokens: int, seconds: float) -> None:
        """One layer of `tokens` tokens, `nbytes` as stored, decoded by `codec` (host part and dequantising on
        the model's device): the codec's decode rate, for a loader."""
        with self._lock:
            c = self._codecs.setdefault(codec, CodecCounts())
            c.layers += 1
            c.bytes += nbytes
            c.token_layers += tokens
            c.seconds += seconds

    def codec_snapshot(self) -> dict[str, dict[str, Any]]:
        """Per codec its decode counts (layers, bytes, token_layers, decode_ms_mean, decode_s_total)."""
        with self._lock:
            return {name: c.as_dict() for name, c in self._codecs.items()}

    def snapshot(self) -> tuple[dict[str, int], dict[str, dict[str, Any]]]:
        """(totals, per tier its counts as a dict), from one moment."""
        with self._lock:
            return dict(self._totals), {name: c.as_dict() for name, c in self._tiers.items()}
