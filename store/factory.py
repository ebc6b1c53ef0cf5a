"""The store the app runs, built from StoreSettings and the model's Placement (decided by the blend backend)."""
from __future__ import annotations

from pathlib import Path

from common.placement import HOST, Placement
from store.base import Tier
from store.disk import DiskTier
from store.memory import MemoryTier
from store.redis_tier import RedisTier
from store.settings import StoreSettings
from store.tiered import TieredStore

GPU_SHARE = 0.2  # gpu_bytes "auto": this share of the device's free memory once the model is loaded


def gpu_bytes(setting: int | str, placement: Placement) -> int:
    """The gpu tier's cap: 0 for a model in host memory (no device memory to hold it in); else `setting`
    itself, or for "auto" GPU_SHARE of the device's free memory."""
    if placement.on_host:
        return 0
    return int(placement.device_free_bytes * GPU_SHARE) if setting == "auto" else int(setting)


def build_store(settings: StoreSettings, kv_dir: Path, fingerprint: str | None,
                placement: Placement = HOST) -> TieredStore:
    """A gpu tier on the model's device (a model off the host only), memory (pinned when the placement
    says), disk under `kv_dir`, then Redis if a URL is set.

    A tier with a 0-byte cap is left out. `fingerprint` None opens it for inspection only (stats).
    """
    tiers: list[Tier] = []
    if (gpu := gpu_bytes(settings.gpu_bytes, placement)) > 0:
        tiers.append(MemoryTier(gpu, device=placement.device, name="gpu"))
    if settings.memory_bytes > 0:
        tiers.append(MemoryTier(settings.memory_bytes, pin=placement.pin))
    if settings.disk_bytes > 0:
        tiers.append(DiskTier(kv_dir, settings.disk_bytes))
    if settings.redis_url:
        tiers.append(RedisTier(settings.redis_url, password=settings.redis_password,
                               prefix=settings.redis_prefix, ttl_s=settings.redis_ttl_s,
                               timeout_s=settings.redis_timeout_s, backoff_s=settings.redis_backoff_s,
                               queue_size=settings.redis_queue_size))
    return TieredStore(tiers, codec=settings.codec, fingerprint=fingerprint, placement=placement,
                       read_threads=settings.read_threads)
