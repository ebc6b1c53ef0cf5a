"""Prompt caching as the clients' APIs ask for it: which of a request's KV entries to lease (store/leases.py),
for which family and how long, and what the response says about it.

- OpenAI (/v1/chat/completions): `prompt_cache_retention: "24h"` leases every entry the prompt used (head,
  conversation, passages) for 24 h to the family `prompt_cache_key`; `"in_memory"` (or none) leaves them
  to plain LRU.
- Anthropic (/v1/messages): each `cache_control` breakpoint leases the prefix up to it for its ttl (5m, 1h);
  an entry under several gets the longest.

A family is its tenant's (app.api.middleware.Tenant): another tenant's family of the same name is another family,
and each tenant has `server.tenant_pinned_share` of each tier's pinned cap reserved to its leases (store/leases.py).
Leases are soft (a hit runs the ttl again) and taken after the answer is decoded, off the model thread
(`lease()` writes to the metadata database). One that a tier refuses (its pinned cap, `store.*_pinned_bytes`,
is reached; the database is down) never fails the request: its entries stay under LRU there, and the response
says so: the header `x-ragblend-lease: held | refused` (non-streamed responses) and a `lease` object in the
body (streamed: on the last event), see `LeaseNote`.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

from pydantic import BaseModel, Field

from app.engine.query import KeyUse
from app.tenants import current_tenant
from store import LeaseResult, TieredStore

LEASE_HEADER = "x-ragblend-lease"
RETENTION_TTL_S = {"24h": 86400.0}  # OpenAI's prompt_cache_retention values that lease ("in_memory": LRU)
DEFAULT_FAMILY = "openai"  # the family of a "24h" request without a prompt_cache_key


class LeaseNote(BaseModel):
    """ragblend extra: what became of the request's lease."""

    status: Literal["held", "refused"] = Field(description="held: every entry is leased in every tier with a "
                                                           "pinned cap; refused: some tier refused (see `refused`) "
                                                           "or an entry was gone; those fall back to LRU.")
    family: str = Field(description="The family's id (GET /v1/cache lists it).")
    entries: int = Field(description="Entries leased.")
    tiers: list[str] = Field(description="Tiers the lease holds in.")
    refused: dict[str, str] = Field(description="Tier -> why it refused the lease.")
    missing: int = Field(description="Entries no tier held any more (nothing to lease).")
    expires_at: float | None = Field(description="When the lease ends unless a hit renews it, unix seconds.")


def prefix_keys(uses: Sequence[KeyUse], through_message: int | None) -> list[str]:
    """The keys of the prompt's prefix up to and including message `through_message` (None: the head alone).
    The head is first; a piece of a later message, and the passages after the conversation, are left out."""
    head, rest = uses[:1], uses[1:]
    if through_message is None:
        return [u.key for u in head]
    return [u.key for u in (*head, *(u for u in rest if u.message is not None and u.message <= through_message))]


def lease(store: TieredStore, family: str, asks: Iterable[tuple[Sequence[str], float]]) -> LeaseNote | None:
    """Lease each (keys, ttl_s) ask to `family` of the request's tenant (its reservation of the pinned caps), a
    key under several at the longest ttl; None: nothing asked. It writes to the database: call it off the event
    loop (Service.blocking's "store" pool)."""
    ttl_of: dict[str, float] = {}
    for keys, ttl_s in asks:
        for key in keys:
            ttl_of[key] = max(ttl_s, ttl_of.get(key, 0.0))
    if not ttl_of:
        return None
    by_ttl: dict[float, list[str]] = {}
    for key, ttl_s in ttl_of.items():
        by_ttl.setdefault(ttl_s, []).append(key)
    tenant = current_tenant().name
    results = [store.lease(keys, family, ttl_s, tenant=tenant) for ttl_s, keys in by_ttl.items()]
    return _note(results)


def _note(results: list[LeaseResult]) -> LeaseNote:
    refused = {tier: why for r in results for tier, why in r.refused.items()}
    missing = sum(len(r.missing) for r in results)
    ends = [r.expires_at for r in results if r.expires_at is not None]
    return LeaseNote(status="refused" if refused or missing else "held", family=results[0].family,
                     entries=sum(len(r.leased) for r in results), tiers=sorted({t for r in results for t in r.tiers}),
                     refused=refused, missing=missing, expires_at=max(ends) if ends else None)


def lease_headers(note: LeaseNote | None) -> dict[str, str]:
    return {LEASE_HEADER: note.status} if note else {}
