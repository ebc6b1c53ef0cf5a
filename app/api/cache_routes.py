"""The cache endpoint: what the KV store holds and leases (GET /v1/cache), dropping a lease family
(DELETE /v1/cache?prompt_cache_key=...), and what a prompt would find cached (POST /v1/cache/lookup).
Behind the API key like every /v1 route.

A family is named by the client's `prompt_cache_key` and listed by its id (store.family_id: a hash), so no
client's text is ever shown to another; a client finds its own with `?prompt_cache_key=`. Tenants (the API
key's, server.api_keys) see and drop only their own families, and a lookup finds only what their own prompts
and the shared documents stored. Figures per
tier are this replica's lookups and the tier's own size (disk and Redis are shared by the replicas on
them); leases are every replica's (from the metadata database, at most `store.lease_refresh_s` old).
"""
from __future__ import annotations

from functools import partial
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from app.api.deps import service, serving
from app.api.query_routes import chat_params
from app.api.schemas.openai import CHAT_RULES, USER_TEXT, ChatCompletionRequest, ChatMessage
from app.api.schemas.ragblend import (
    ERRORS,
    ID_RULE,
    MAX_CACHE_KEY_CHARS,
    MODEL_NOT_FOUND,
    NonBlank,
    check_budget,
    check_limits,
)
from app.serving.parts import Serving
from app.serving.service import Service
from app.tenants import current_tenant
from app.validation import ONE_LINE_NOT_BLANK, valid_id
from store import family_id

router = APIRouter()
CacheKey = Annotated[str, Query(min_length=1, max_length=MAX_CACHE_KEY_CHARS, pattern=ONE_LINE_NOT_BLANK,
                                description=f"The client's prompt_cache_key: the lease family. {ID_RULE}"),
                     AfterValidator(partial(valid_id, max_chars=MAX_CACHE_KEY_CHARS))]


class TierCache(BaseModel):
    entries: int | None = Field(description="Entries held (null where the tier cannot say).")
    bytes: int | None = Field(description="Bytes held (Redis: the server's memory used).")
    capacity: int | None = Field(None, description="The tier's byte cap (null: Redis's own maxmemory).")
    pinned_bytes: int = Field(description="Bytes running leases pin in this tier.")
    pinned_cap: int = Field(description="The most bytes leases may pin here (store.*_pinned_bytes); a tenant's "
                                        "view: the bytes reserved to its leases (it may pin more while room no "
                                        "tenant reserved is free).")
    hits: int = Field(description="This replica's lookups found here (a tenant's own: its chunks read here).")
    misses: int | None = Field(description="This replica's lookups not found here (null: a tenant's view).")
    hit_rate: float | None = Field(description="hits / (hits + misses); null before any lookup.")
    evictions: int | None = Field(description="Entries LRU (or Redis) evicted.")
    lease_held: int | None = Field(description="Evictions that passed over a leased entry (the lease kept it).")
    lease_refusals: int | None = Field(description="Leases this replica refused here: the pinned cap was reached.")


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
    expired: int = Field(description="Lease holds this replica's lease sweep ended by expiry.")
    dropped_puts: dict[str, int] | None = Field(description=(
        "Chunks of requests' prompts this replica's store writer refused, not stored, by the bound that was full: "
        "entries, bytes, closed (null for a tenant that is not an admin)."))
    pending_bytes: int | None = Field(description="Bytes of chunks waiting for this replica's store writer "
                                                  "(null for a tenant that is not an admin).")
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
                 svc: Service = Depends(service)) -> CacheReport:
    """Bytes and entries per tier, pinned bytes, hit rates, and leases by family. An admin (server.admin_keys, or
    any caller without keys) sees the store's counters; another tenant its own: the chunks its requests read from
    each tier and its own leases, none of the store-wide counts (entries, bytes, evictions, refusals)."""
    tenant, store = current_tenant(), svc.serving.store
    stats, leases = store.stats(), store.lease_stats(prompt_cache_key, limit, tenant.name)
    tiers = {name: _tier(name, tier, leases) for name, tier in stats["tiers"].items()}
    hit_rate = _rate(stats["hits"], stats["misses"])
    if not tenant.admin:
        own = svc.metrics.tenant_chunks.get(tenant.name, {})
        tiers = {name: _own(name, tier, own, leases) for name, tier in tiers.items()}
        read = sum(own.get(name, 0) for name in tiers)
        hit_rate = _rate(read, own.get("computed", 0))
    return CacheReport(hit_rate=hit_rate, leases=leases["leases"], families=leases["families"],
                       leased_entries=leases["entries"], expired=leases["expired"], tiers=tiers,
                       dropped_puts=stats["dropped_puts_by"] if tenant.admin else None,
                       pending_bytes=stats["pending_bytes"] if tenant.admin else None,
                       data=leases["by_family"])


def _own(name: str, tier: TierCache, own: dict[str, int], leases: dict[str, Any]) -> TierCache:
    """A tier as one tenant sees it: its chunks read there, its pins against its reservation of the cap."""
    return TierCache(entries=None, bytes=None, capacity=tier.capacity, pinned_bytes=tier.pinned_bytes,
                     pinned_cap=leases["reserved"].get(name, 0), hits=own.get(name, 0), misses=None,
                     hit_rate=None, evictions=None, lease_held=None, lease_refusals=None)


@router.delete("/v1/cache", response_model=CacheDropped, responses=ERRORS)
def drop_family(prompt_cache_key: CacheKey, parts: Serving = Depends(serving)) -> CacheDropped:
    """End a family's leases and delete its entries (a family with no running lease: nothing to do)."""
    tenant = current_tenant().name
    ended, deleted = parts.store.drop_family(prompt_cache_key, keep=parts.owned_keys, tenant=tenant)
    return CacheDropped(family=family_id(prompt_cache_key, tenant), leases_ended=ended, entries_deleted=deleted)


def _tier(name: str, tier: dict[str, Any], leases: dict[str, Any]) -> TierCache:
    return TierCache(entries=tier.get("entries"), bytes=tier.get("bytes"), capacity=tier.get("capacity"),
                     pinned_bytes=leases["pinned_bytes"].get(name, 0), pinned_cap=leases["caps"].get(name, 0),
                     hits=tier["hits"], misses=tier["misses"], hit_rate=_rate(tier["hits"], tier["misses"]),
                     evictions=tier.get("evictions"), lease_held=tier.get("lease_held"),
                     lease_refusals=leases["refused"].get(name, 0))


def _rate(hits: int, misses: int) -> float | None:
    return round(hits / (hits + misses), 4) if hits + misses else None


# ---- POST /v1/cache/lookup -----------------------------------------------------------------------

# Exactly one of messages (with a user message with text, as a chat needs) and prompt, in JSON Schema.
_ONE_PROMPT = {"oneOf": [
    {"required": ["messages"], "properties": {"messages": {"type": "array", "contains": USER_TEXT},
                                              "prompt": {"type": "null"}}},
    {"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}}}]}


class LookupRequest(ChatCompletionRequest):
    """A chat completions request (its `messages`, `tools`, `retrieval`, `model`, `top_k`), or a /v1/query
    question as `prompt`: what its prompt would read from the store, looked up, nothing computed."""

    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra={**_ONE_PROMPT, **CHAT_RULES})
    messages: list[ChatMessage] | None = Field(None, description="A chat's messages (or give `prompt`).")  # type: ignore[assignment]
    prompt: NonBlank | None = Field(None, description="A /v1/query question (or give `messages`).")

    @model_validator(mode="after")
    def _one_prompt(self) -> LookupRequest:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give exactly one of messages and prompt")
        return self


class LookupPiece(BaseModel):
    kind: Literal["head", "message", "opening", "passage"] = Field(
        description="The system turn, a chat message, the passages' turn opening, or a retrieved passage.")
    message: int | None = Field(description="A message piece: its index in `messages` (the last it covers).")
    tokens: int
    cached: Literal["exact", "blendable"] | None = Field(
        description="exact: stored after exactly the tokens before it, used as is; blendable: stored, reused "
                    "at this position by RoPE shift and blend; null: not stored, to be computed.")
    tier: str | None = Field(description="The tier that holds it (gpu, memory, disk, redis).")


class LookupReport(BaseModel):
    object: Literal["cache.lookup"] = "cache.lookup"
    prompt_tokens: int
    cached_tokens: int = Field(description="Tokens whose KV the store holds (exact + blendable).")
    exact_tokens: int = Field(description="Of those, the exact prefix.")
    blendable_tokens: int
    pieces: list[LookupPiece] = Field(description="The prompt's pieces in order (the question, always computed, "
                                                  "is left out).")


@router.post("/v1/cache/lookup", response_model=LookupReport, responses={**ERRORS, **MODEL_NOT_FOUND})
async def cache_lookup(body: LookupRequest, svc: Service = Depends(service)) -> LookupReport:
    """How many of a prompt's tokens the store holds, exact or blendable, and where: from the same plan the
    request would run (app.engine.rag_engine.RagEngine.lookup), as it would be laid out now."""
    if body.prompt is not None:
        check_limits(svc.settings.limits, question=body.prompt, top_k=body.top_k, question_field="prompt",
                     max_tokens={"max_completion_tokens": body.max_completion_tokens, "max_tokens": body.max_tokens})
        await svc.blocking("lookup", check_budget, svc.settings.limits, [("prompt", body.prompt)], svc.count_tokens,
                                "prompt")
        params = svc.query_params(body.prompt, top_k=body.top_k, max_tokens=body.new_tokens(), mode=body.mode)
    else:
        params = await chat_params(body, svc)  # type: ignore[arg-type]
    plan = await svc.lookup(params)
    cached = {"exact": "exact", "blended": "blendable", "compute": None}
    pieces = [LookupPiece(kind=s.kind, message=s.message, tokens=len(s.ids), cached=cached[s.source], tier=s.tier)
              for s in plan.spans]  # app.engine.planner's spans: a long message is cut into several
    tokens = {kind: sum(p.tokens for p in pieces if p.cached == kind) for kind in ("exact", "blendable")}
    return LookupReport(prompt_tokens=plan.prompt_tokens, cached_tokens=sum(tokens.values()),
                        exact_tokens=tokens["exact"], blendable_tokens=tokens["blendable"], pieces=pieces)
