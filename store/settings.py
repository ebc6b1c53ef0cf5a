"""The store's own settings (the app nests them under `store`)."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from common.settings import Strict
from store.admission import AdmissionPolicy
from store.codecs import DEFAULT_BINS, BinPlan


class CacheGenBins(Strict):
    """The cachegen codec's bins per layer: [first layer, bins] bands for keys and values (store.codecs.BinPlan)."""

    keys: list[tuple[int, int]] = list(DEFAULT_BINS.keys)
    values: list[tuple[int, int]] = list(DEFAULT_BINS.values)

    @model_validator(mode="after")
    def _valid(self) -> CacheGenBins:
        self.plan()  # raises ValueError for bands that do not start at layer 0, ascend, or hold 4-256 bins
        return self

    def plan(self) -> BinPlan:
        return BinPlan.of(self.model_dump())


CodecName = Literal["native", "fp16", "int8", "int4", "cachegen"]
TIERS = ("gpu", "memory", "disk", "redis")


class TierCodecs(Strict):
    """The codec each tier keeps its entries in (configs/default.yaml says why each default). A tensor tier
    (gpu, memory) keeps the codec's round trip in the model's dtype; a byte tier, its encoding."""

    gpu: CodecName = "int8"
    memory: CodecName = "int8"
    disk: CodecName = "int8"
    redis: CodecName = "int8"


class StoreSettings(Strict):
    codec: CodecName | TierCodecs = TierCodecs()  # one codec for every tier, or one per tier
    cachegen_bins: CacheGenBins = CacheGenBins()
    # auto: a share of the device's free memory; 0 for a model on the host
    gpu_bytes: Annotated[int, Field(ge=0)] | Literal["auto"] = "auto"
    memory_bytes: int = Field(2 << 30, ge=0)
    disk_bytes: int = Field(4 << 30, ge=0)
    redis_url: str | None = None
    redis_password: str | None = None
    redis_prefix: str = "ragblend:"
    redis_ttl_s: int | None = None
    redis_timeout_s: float = 0.5
    redis_backoff_s: float = 5.0
    redis_queue_size: int = 256
    read_threads: int = Field(4, ge=0)  # layers of open entries read ahead concurrently; 0: serial reads
    # Leases (store/leases.py): the most bytes leased entries may pin in each tier (configs/default.yaml
    # says why each default), at most the tier's own cap; 0 turns leases off in that tier.
    gpu_pinned_bytes: Annotated[int, Field(ge=0)] | Literal["auto"] = "auto"  # auto: half the gpu tier
    memory_pinned_bytes: int = Field(1 << 30, ge=0)
    disk_pinned_bytes: int = Field(2 << 30, ge=0)
    redis_pinned_bytes: int = Field(1 << 30, ge=0)
    lease_refresh_s: float = Field(1.0, gt=0)  # how stale a store's view of the shared leases may be
    # What a request stores from its prompt is written by the store's own thread (TieredStore.put_nowait): at most
    # this many chunks / bytes wait at once; past either, a chunk is dropped (counted), never waited for.
    write_queue: int = Field(4096, ge=1)  # three requests' spans (planner.max_spans x 2 entries each) fit
    write_queue_bytes: int = Field(3 << 29, ge=0)
    # Which tiers take what requests store (store/admission.py): everywhere; second_sight (gpu/memory at once,
    # disk and Redis once the key is seen again within the last `admission_window` keys, or leased); frequency
    # (second_sight, but a tier with free room, or whose evictions would hit only never re-used entries, takes a
    # first sight too).
    admission: AdmissionPolicy = "frequency"
    admission_window: int = Field(65536, ge=1)

    def codec_of(self, tier: str) -> str:
        """The codec `tier` (gpu, memory, disk, redis) keeps its entries in."""
        return self.codec if isinstance(self.codec, str) else getattr(self.codec, tier)

    def codecs(self) -> dict[str, str]:
        """Every tier's codec, by tier name."""
        return {tier: self.codec_of(tier) for tier in TIERS}
