"""The cache endpoint: what the KV store holds and leases (GET /v1/cache), and dropping a lease family
(DELETE /v1/cache?prompt_cache_key=...). Behind the API key like every /v1 route.

A family is named by the client's `prompt_cache_key` and listed by its id (store.family_id: a hash), so no
client's text is ever shown to another; a client finds its own with `?prompt_cache_key=`. Figures per
tier are this replica's lookups and the tier's own size (disk and Redis are shared by the replicas on
them); leases are every replica's (from the metadata database, at most `store.lease_refresh_s` old).
"""
from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from pydantic import AfterValidator, BaseModel, Field

from app.api_models import ERRORS, MAX_CACHE_KEY_CHARS
from app.components import Serving
from app.service import serving
from app.validation import valid_unicode
from store import family_id

router = APIRouter()
CacheKey = Annotated[str, Query(min_length=1, max_length=MAX_CACHE_KEY_CHARS,
                                description="The client's prompt_cache_key: the lease family."),
                     AfterValidator(valid_unicode)]


class TierCache(BaseModel):
    entries: int | None = Field(description="Entries held (null where the tier cannot say).")
    bytes: int | None = Field(description="Bytes held (Redis: the server's memory used).")
    capacity: int | None = Field(None, description="The tier's byte cap (null: Redis's own maxmemory).")
    pinned_bytes: int = Field(description="Bytes running leases pin in this tier.")
    pinned_cap: int = Field(description="The most bytes leases may pin here (store.*_pinned_bytes).")
    hits: int = Field(description="This replica's lookups found here.")
    misses: int = Field(description="This replica's lookups not found here.")
    hit_rate: float | None = Field(description="hits / (hits + misses); null before any lookup.")
    evictions: int | None = Field(description="Entries LRU (or Redis) evicted.")
    lease_held: int | None = Field(description="Evictions that passed over a leased entry (the lease kept it).")
    lease_refusals: int = Field(description="Leases this replica refused here: the pinned cap was reached.")


class FamilyCache(BaseModel):
    family: str = Field(description="The family's id: a hash of its prompt_cache_key.")
    entries: int = Field(description="Entries its leases hold.")
    pinned_bytes: dict[str, int] = Field(description="Bytes its leases pin, per tier.")
    soft: bool = Field(description="Every lease of the family is renewed by a hit.")
    expires_at: float = Field(description="When its last lease ends, unix seconds (if not renewed).")


class CacheReport(BaseModel):
    object: str = "cache"
    hit_rate: float | None = Field(description="This replica's lookups found in some tier, of all its lookups.")
    leases: int = Field(description="Running leases (family, entry pairs), all replicas.")
    families: int = Field(description="Families with a running lease.")
    leased_entries: int = Field(description="Entries some running lease holds.")
    expired: int = Field(description="Lease holds this replica's sweeper ended by expiry.")
    tiers: dict[str, TierCache]
    data: list[FamilyCache] = Field(description="The families pinning the most (or the one asked for).")


class CacheDropped(BaseModel):
    object: str = "cache.family.deleted"
    family: str = Field(description="The family's id.")
    leases_ended: int = Field(description="Entries the family's leases held.")
    entries_deleted: int = Field(description="Entries deleted from every tier (those another family leases, and "
                                             "documents' passages, stay).")


@router.get("/v1/cache", response_model=CacheReport, responses=ERRORS)
def cache_report(prompt_cache_key: CacheKey | None = None,
                 limit: Annotated[int, Query(ge=0, le=1000, description="Families listed at most.")] = 100,
                 parts: Serving = Depends(serving)) -> CacheReport:
    """Bytes and entries per tier, pinned bytes, hit rates, and leases by family."""
    stats, leases = parts.store.stats(), parts.store.lease_stats(prompt_cache_key, limit)
    return CacheReport(hit_rate=_rate(stats["hits"], stats["misses"]), leases=leases["leases"],
                       families=leases["families"], leased_entries=leases["entries"], expired=leases["expired"],
                       tiers={name: _tier(name, tier, leases) for name, tier in stats["tiers"].items()},
                       data=leases["by_family"])


@router.delete("/v1/cache", response_model=CacheDropped, responses=ERRORS)
def drop_family(prompt_cache_key: CacheKey, parts: Serving = Depends(serving)) -> CacheDropped:
    """End a family's leases and delete its entries (a family with no running lease: nothing to do)."""
    ended, deleted = parts.store.drop_family(prompt_cache_key, keep=parts.owned_keys)
    return CacheDropped(family=family_id(prompt_cache_key), leases_ended=ended, entries_deleted=deleted)


def _tier(name: str, tier: dict[str, Any], leases: dict[str, Any]) -> TierCache:
    return TierCache(entries=tier.get("entries"), bytes=tier.get("bytes"), capacity=tier.get("capacity"),
                     pinned_bytes=leases["pinned_bytes"].get(name, 0), pinned_cap=leases["caps"].get(name, 0),
                     hits=tier["hits"], misses=tier["misses"], hit_rate=_rate(tier["hits"], tier["misses"]),
                     evictions=tier.get("evictions"), lease_held=tier.get("lease_held"),
                     lease_refusals=leases["refused"].get(name, 0))


def _rate(hits: int, misses: int) -> float | None:
    return round(hits / (hits + misses), 4) if hits + misses else None
