"""The store the app runs, built from StoreSettings and the model's Placement (decided by the blend backend)."""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path

from common.housekeeping import Housekeeping
from common.placement import HOST, Placement
from store.admission import Admission
from store.base import Tier
from store.codecs import Codec
from store.disk import DiskTier
from store.eviction import Pinned, never_pinned
from store.leases import LeaseLedger, Leases
from store.memory import MemoryTier
from store.redis_tier import RedisTier
from store.settings import StoreSettings
from store.tiered import TieredStore

GPU_SHARE = 0.2  # gpu_bytes "auto": this share of the device's free memory once the model is loaded
GPU_PINNED_SHARE = 0.5  # gpu_pinned_bytes "auto": this share of the gpu tier


def gpu_bytes(setting: int | str, placement: Placement) -> int:
    """The gpu tier's cap: 0 for a model in host memory (no device memory to hold it in); else `setting`
    itself, or for "auto" GPU_SHARE of the device's free memory."""
    if placement.on_host:
        return 0
    return int(placement.device_free_bytes * GPU_SHARE) if setting == "auto" else int(setting)


def pinned_caps(settings: StoreSettings, gpu: int) -> dict[str, int]:
    """The pinned cap of each tier the settings build (tier name -> bytes), at most the tier's own cap;
    Redis's size is Redis's own."""
    gpu_pinned = int(gpu * GPU_PINNED_SHARE) if settings.gpu_pinned_bytes == "auto" else settings.gpu_pinned_bytes
    caps = {"gpu": (gpu, gpu_pinned), "memory": (settings.memory_bytes, settings.memory_pinned_bytes),
            "disk": (settings.disk_bytes, settings.disk_pinned_bytes)}
    built = {name: min(cap, pinned) for name, (cap, pinned) in caps.items() if cap > 0}
    return built | ({"redis": settings.redis_pinned_bytes} if settings.redis_url else {})


def build_store(settings: StoreSettings, kv_dir: Path, fingerprint: str | None,
                placement: Placement = HOST, ledger: LeaseLedger | None = None,
                clock: Callable[[], float] = time.time, codecs: Mapping[str, Codec] | None = None,
                housekeeping: Housekeeping | None = None,
                tenant_shares: Mapping[str, float] | None = None) -> TieredStore:
    """A gpu tier on the model's device (a model off the host only), memory (pinned when the placement
    says), disk under `kv_dir`, then Redis if a URL is set.

    A tier with a 0-byte cap is left out. `fingerprint` None opens it for inspection only (stats).
    `ledger` (the metadata database): leases kept there, honoured by every tier from its first eviction;
    None: a store without leases. `clock`: the leases' time, unix seconds. `codecs`: each tier's codec
    (cachegen's with its tables: app/cachegen.py); default: by name from the settings (cachegen then only
    reads and round-trips, it cannot encode). `housekeeping`: the process's thread for periodic work, which sweeps
    the leases (None: the store starts its own). `tenant_shares`: tenant name ("" the default tenant) -> the share of
    each tier's pinned cap reserved to its leases (store/leases.py); a tenant left out has none.
    """
    gpu = gpu_bytes(settings.gpu_bytes, placement)
    leases = None if ledger is None else Leases(ledger, pinned_caps(settings, gpu), clock, settings.lease_refresh_s,
                                                tenant_shares)

    def pinned(tier: str) -> Pinned:
        return never_pinned if leases is None else leases.pinned_in(tier)

    tiers: list[Tier] = []
    if gpu > 0:
        tiers.append(MemoryTier(gpu, device=placement.device, name="gpu", pinned=pinned("gpu")))
    if settings.memory_bytes > 0:
        tiers.append(MemoryTier(settings.memory_bytes, pin=placement.pin, pinned=pinned("memory")))
    if settings.disk_bytes > 0:
        tiers.append(DiskTier(kv_dir, settings.disk_bytes, pinned=pinned("disk")))
    if settings.redis_url:
        tiers.append(RedisTier(settings.redis_url, password=settings.redis_password,
                               prefix=settings.redis_prefix, ttl_s=settings.redis_ttl_s,
                               timeout_s=settings.redis_timeout_s, backoff_s=settings.redis_backoff_s,
                               queue_size=settings.redis_queue_size, pinned=pinned("redis")))
    return TieredStore(tiers, codec=codecs or settings.codecs(), fingerprint=fingerprint, placement=placement,
                       read_threads=settings.read_threads, leases=leases,
                       admission=Admission(settings.admission, settings.admission_window),
                       write_queue=settings.write_queue, write_queue_bytes=settings.write_queue_bytes,
                       housekeeping=housekeeping)
