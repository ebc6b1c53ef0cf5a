"""Leases: KV entries a client asked the store to keep, held against LRU eviction in every tier.

A lease holds one store key under a *family* (the client's `prompt_cache_key`, or a name the request
side derives) until it ends; a *soft* lease runs its ttl again on every hit. While it runs, the entry
is never evicted by LRU in a tier the lease holds in: the memory and gpu tiers and diskcache's cull
pass over it (store/eviction.py, store/disk.py), and in Redis it carries no TTL (store/redis_tier.py
says what Redis's own maxmemory policy can still do).

Caps. A tier pins at most its cap of leased bytes (`store.*_pinned_bytes`; a key counts once however
many families hold it, at the bytes it takes in that tier). A lease that would pass a tier's cap is
refused in that tier as a whole - its entries fall back to LRU there - and the result says which tiers
refused and why, for the request side to tell the client. A cap of 0 turns leases off in a tier.

Reservations. The tenants the store is told of (`shares`: name -> share, "" the default tenant) each have
their share of every tier's pinned cap reserved (the shares scaled down evenly where they add up to more
than 1): a tenant may always pin up to its reservation, and no other tenant's pins eat into what it leaves
unused; the rest of the cap is shared first-come. So a lease is granted in a tier while its tenant's pins
stay within the more of its reservation and the cap less what every other tenant takes (the more of its
pins and its reservation), checked on this store's snapshot of the leases (the cap itself is the ledger's, in
its transaction). A refusal quotes the caller's own pins and reservation, never another's.

Where leases live. In the metadata database (SQLite or PostgreSQL) through a `LeaseLedger`
(retrieval.Metadata is one; app/components.py hands it to the store): replicas that share the database
(and the disk dir or Redis) honour one another's leases, and leases survive a restart. Eviction never
asks the database: a store keeps a snapshot of the running leases (`Leases`), read again after each of
its own grants and releases and every `refresh_s` by the store's one sweeper thread, which also writes
the renewals that hits made (batched) and deletes the leases that have ended. The staleness accepted:
- another replica's new lease is honoured here up to `refresh_s` later; until then this process's LRU
  may evict that entry from its own memory or the shared disk (recomputed when next needed);
- a renewal reaches the database up to `refresh_s` after its hit (lost if the process dies first);
  meanwhile other replicas take a lease renewed in its last `refresh_s` for ended: their sweeper may
  delete it (the renewal is lost), their LRU evict its entry, their grants give its bytes to another
  lease (a tier's pinned bytes may then pass its cap until the renewal lands);
- an ended lease stops protecting at once: its end is in the snapshot and checked against the clock
  at every eviction, whatever the sweeper has done. Replicas' clocks must agree (NTP) well within a ttl.

API for the request side (on store.TieredStore):

    store.lease(keys, family, ttl_s, soft=True, tenant="") -> LeaseResult
        Hold the entries under `keys` (put or found first: a key no tier holds is `missing`) for the
        family of `tenant`, for `ttl_s` seconds. `family` is free text: it is hashed here (`family_id`) and never
        reaches a path, a Redis key or the database. The result: `family` (its id), `leased`, `missing`,
        `tiers` the lease holds in, `refused` {tier: why} (its entries fall back to LRU there),
        `expires_at`, `pinned_bytes` {tier: bytes pinned now}; `complete` when nothing was refused or
        missing. A refusal or a database outage is reported in `refused`, never raised. It writes to
        the database (and may wait on its lock): call it off the model thread, e.g. after the answer.
    store.release(family) -> int                 end the family's leases early (entries stay, under LRU)
    store.drop_family(family, keep) -> (int, int)  end them and delete their entries, except those another
                                                  family leases or `keep(keys)` names (documents' KV)
    store.lease_stats(family=None) -> dict       leases, families, pinned bytes and caps per tier, refusals,
                                                  expiries; `by_family` (ids, entries, bytes per tier, end)
    family_id(text) -> str                       the id a family is listed under
Renewal is the store's own: every hit in its walk (get, open) renews the entry's soft leases.
"""
from __future__ import annotations

import hashlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Protocol

REFRESH_S = 1.0  # the snapshot's age at most (and how often renewals are written, ended leases deleted)

Freed = tuple[str, str, bool]  # (key, tier, whether another running lease still holds the key in the tier)


class LeaseLedger(Protocol):
    """Where leases live: the metadata database (retrieval.Metadata satisfies this). Times are the store's
    clock, in seconds (unix time unless a test gives another clock)."""

    def grant_leases(self, family: str, sizes: Mapping[str, Mapping[str, int]], caps: Mapping[str, int],
                     ttl_s: float, soft: bool, now: float) -> dict[str, tuple[bool, int, int]]:
        """In one transaction serialized with every other lease change: per tier of `caps`, lease every key of
        `sizes` (key -> tier -> bytes) there if the running leases' bytes (each key once) plus these stay
        within the cap. Per tier: (granted, bytes pinned before, bytes this lease adds)."""

    def renew_leases(self, hits: Mapping[str, float]) -> None:
        """Per key hit at a time: its soft leases that were running then run their ttl again from then."""

    def release_leases(self, family: str, now: float) -> list[Freed]:
        """Delete the family's leases; one Freed per (key, tier) one that was running held."""

    def expire_leases(self, now: float) -> list[Freed]:
        """Delete the leases ended by `now`; one Freed per (key, tier) they held."""

    def active_leases(self, now: float) -> list[tuple[str, str, str, int, float, bool, float]]:
        """The leases running at `now`: (family, key, tier, bytes, ttl_s, soft, expires_at)."""


def family_id(family: str, tenant: str = "") -> str:
    """The id a family is known by: 32 hex digits of sha256 (its text is kept nowhere), after its tenant's tag
    and a dot for a named tenant."""
    if not family:
        raise ValueError("a lease family must not be empty")
    scoped = f"{tenant}\0{family}" if tenant else family
    digest = hashlib.sha256(b"ragblend.lease-family\0" + scoped.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return f"{tenant_tag(tenant)}.{digest}" if tenant else digest


def tenant_tag(tenant: str) -> str:
    """The tag a tenant's family ids start with ("" for the default tenant)."""
    if not tenant:
        return ""
    return hashlib.sha256(b"ragblend.tenant\0" + tenant.encode("utf-8", "surrogatepass")).hexdigest()[:8]


def _tag_of(family: str) -> str:
    return family.partition(".")[0] if "." in family else ""


@dataclass(frozen=True)
class Lease:
    """One running lease of one key in one tier (a ledger row)."""

    family: str
    key: str
    tier: str
    nbytes: int
    ttl_s: float
    soft: bool
    expires_at: float


@dataclass(frozen=True)
class LeaseResult:
    """What `TieredStore.lease` did (see the module doc)."""

    family: str  # the family's id
    leased: tuple[str, ...]  # keys the lease holds, in `tiers`
    missing: tuple[str, ...]  # keys no tier holds: nothing to lease
    tiers: tuple[str, ...]  # where it holds them
    refused: dict[str, str]  # tier -> why it did not (the entries fall back to LRU there)
    expires_at: float | None  # None: nothing was leased
    pinned_bytes: dict[str, int]  # per tier, the bytes every running lease pins there now

    @property
    def complete(self) -> bool:
        return not self.refused and not self.missing


class Leases:
    """A store's view of the lease ledger: the running leases (a snapshot), the tiers' caps, and the changes
    this process makes. Thread-safe; `holds` is a dict lookup, never a database query. Ledger errors reach
    the caller (the store reports them)."""

    def __init__(self, ledger: LeaseLedger, caps: Mapping[str, int], clock: Callable[[], float] = time.time,
                 refresh_s: float = REFRESH_S, shares: Mapping[str, float] | None = None) -> None:
        """`caps`: tier name -> its pinned cap in bytes (a tier left out is never leased); `clock`: unix seconds;
        `shares`: tenant name -> the share of each cap reserved to it (a tenant left out has none)."""
        self.ledger, self.caps, self.clock, self.refresh_s = ledger, dict(caps), clock, refresh_s
        scale = max(1.0, sum((shares or {}).values()))  # reservations never add up to more than the cap
        self.shares = {tenant_tag(name): share / scale for name, share in (shares or {}).items()}  # tag -> share
        self._lock = threading.Lock()
        self._granting = threading.Lock()  # one grant at a time here: a reservation checked is still free
        self._by_key: dict[str, tuple[Lease, ...]] = {}  # replaced whole by refresh(), renewals patch it
        self._hits: dict[str, float] = {}  # renewals not yet in the ledger: key -> its last hit
        self._refused: Counter[str] = Counter()
        self._expired = 0
        self.refresh()

    # --- what the tiers and the store's walk ask ------------------------------------------------

    def holds(self, tier: str, key: str) -> bool:
        """Whether a running lease holds `key` in `tier`."""
        leases = self._by_key.get(key)
        if not leases:
            return False
        now = self.clock()
        return any(lease.tier == tier and lease.expires_at > now for lease in leases)

    def pinned_in(self, tier: str) -> Callable[[str], bool]:
        """`holds` for one tier: what the tier is built with (store.eviction.Pinned)."""
        return partial(self.holds, tier)

    def hit(self, key: str) -> None:
        """A hit on `key`: its running soft leases run their ttl again from now (here at once, in the ledger
        at the next sweep)."""
        leases = self._by_key.get(key)
        if not leases or not any(lease.soft for lease in leases):
            return
        now = self.clock()
        with self._lock:
            self._hits[key] = now
            self._renew(key, now)

    def _renew(self, key: str, now: float) -> None:
        """Under the lock: the snapshot's soft leases of `key` running at `now` end ttl after it."""
        if key in self._by_key:
            self._by_key[key] = tuple(replace(lease, expires_at=max(lease.expires_at, now + lease.ttl_s))
                                      if lease.soft and lease.expires_at > now else lease
                                      for lease in self._by_key[key])

    def leased_keys(self) -> set[str]:
        """Every key a running lease holds, in any tier."""
        now = self.clock()
        return {key for key, leases in self._by_key.items() if any(lease.expires_at > now for lease in leases)}

    # --- changes: each goes to the ledger, then the snapshot is read again -----------------------

    def grant(self, family: str, sizes: Mapping[str, Mapping[str, int]], missing: Collection[str], ttl_s: float,
              soft: bool) -> LeaseResult:
        """Lease the keys of `sizes` (key -> tier -> bytes) to `family` (an id) where the caps and the other
        tenants' reservations allow."""
        self._flush_hits()
        with self._granting:
            now = self.clock()
            mine = self._pinned_by_tenant().get(_tag_of(family), {})  # a refusal quotes the caller's own pins
            reserved = self._past_reservation(family, sizes)
            caps = {tier: cap for tier, cap in self.caps.items() if tier not in reserved}
            outcome = self.ledger.grant_leases(family, sizes, caps, ttl_s, soft, now)
            self.refresh()
        refused = {tier: _why(self.caps[tier], mine.get(tier, 0), adds) for tier, (granted, _, adds) in outcome.items()
                   if not granted} | reserved
        with self._lock:
            self._refused.update(refused.keys())
        tiers = tuple(tier for tier, (granted, _, _) in outcome.items() if granted)
        return LeaseResult(family, tuple(sizes) if tiers else (), tuple(missing), tiers, refused,
                           now + ttl_s if tiers else None, self.pinned_bytes())

    def _past_reservation(self, family: str, sizes: Mapping[str, Mapping[str, int]]) -> dict[str, str]:
        """Tier -> why, for each tier where this lease would take its tenant past both its reservation and the
        cap less what the other tenants take (each the more of its pins and its reservation)."""
        tag, pinned = _tag_of(family), self._pinned_by_tenant()
        held = {(lease.tier, lease.key) for lease in self._running() if _tag_of(lease.family) == tag}
        over = {}
        for tier, cap in self.caps.items():
            adds = sum(s.get(tier, 0) for key, s in sizes.items() if (tier, key) not in held)
            mine, reserved = pinned.get(tag, {}).get(tier, 0), int(self.shares.get(tag, 0.0) * cap)
            others = sum(max(pinned.get(t, {}).get(tier, 0), int(self.shares.get(t, 0.0) * cap))
                         for t in (pinned.keys() | self.shares.keys()) - {tag})
            if adds and cap and mine + adds > max(reserved, cap - others):
                over[tier] = (f"{adds} bytes more pass this tenant's reservation of {reserved} bytes of the tier's "
                              f"pinned cap of {cap} ({mine} pinned already), and the unreserved rest is in use")
        return over

    def _pinned_by_tenant(self) -> dict[str, dict[str, int]]:
        """Tenant tag -> tier -> the bytes its running leases pin (each key once per tenant)."""
        by_tenant: dict[str, list[Lease]] = {}
        for lease in self._running():
            by_tenant.setdefault(_tag_of(lease.family), []).append(lease)
        return {tag: self.pinned_bytes(leases) for tag, leases in by_tenant.items()}

    def reserved(self, tenant: str) -> dict[str, int]:
        """Per tier, the bytes reserved to `tenant`."""
        return {tier: int(self.shares.get(tenant_tag(tenant), 0.0) * cap) for tier, cap in self.caps.items()}

    def release(self, family: str) -> list[Freed]:
        self._flush_hits()
        freed = self.ledger.release_leases(family, self.clock())
        self.refresh()
        return freed

    def sweep(self) -> list[Freed]:
        """The sweeper's pass: renewals written, ended leases deleted, the snapshot read again."""
        self._flush_hits()
        freed = self.ledger.expire_leases(self.clock())
        with self._lock:
            self._expired += len(freed)
        self.refresh()
        return freed

    def refresh(self) -> None:
        """Read the running leases again (renewals made since the last flush stay applied)."""
        by_key: dict[str, list[Lease]] = {}
        for row in self.ledger.active_leases(self.clock()):
            lease = Lease(*row)
            by_key.setdefault(lease.key, []).append(lease)
        with self._lock:
            self._by_key = {key: tuple(leases) for key, leases in by_key.items()}
            for key, when in self._hits.items():
                self._renew(key, when)

    def _flush_hits(self) -> None:
        with self._lock:
            hits, self._hits = self._hits, {}
        if not hits:
            return
        try:
            self.ledger.renew_leases(hits)
        except BaseException:
            with self._lock:  # written at the next flush
                self._hits = hits | self._hits
            raise

    # --- figures --------------------------------------------------------------------------------

    def _running(self) -> list[Lease]:
        now = self.clock()
        return [lease for leases in list(self._by_key.values()) for lease in leases if lease.expires_at > now]

    def pinned_bytes(self, leases: list[Lease] | None = None) -> dict[str, int]:
        """Per tier of the caps, the bytes running leases pin (each key once)."""
        per_key = {(lease.tier, lease.key): lease.nbytes for lease in (self._running() if leases is None else leases)}
        pinned = dict.fromkeys(self.caps, 0)
        for (tier, _), nbytes in per_key.items():
            pinned[tier] = pinned.get(tier, 0) + nbytes
        return pinned

    def stats(self, family: str | None = None, limit: int = 100, tenant: str | None = None) -> dict[str, Any]:
        """Leases (family, key pairs), families, entries, pinned bytes and caps per tier, refusals per tier and
        lease holds ended by expiry (this process's counts), and `by_family`: the `limit` families pinning the
        most (or `family` alone, an id), each with its entries, bytes per tier, softness and latest end. With
        `tenant`, the leases of that tenant's families alone, and `reserved`: the bytes reserved to it per tier."""
        running = self._running()
        if tenant is not None:
            running = [lease for lease in running if _tag_of(lease.family) == tenant_tag(tenant)]
        families: dict[str, dict[str, Any]] = {}
        for lease in running:
            f = families.setdefault(lease.family, {"family": lease.family, "entries": set(), "pinned_bytes": {},
                                                   "soft": lease.soft, "expires_at": lease.expires_at})
            f["entries"].add(lease.key)
            f["pinned_bytes"][lease.tier] = f["pinned_bytes"].get(lease.tier, 0) + lease.nbytes
            f["expires_at"] = max(f["expires_at"], lease.expires_at)
            f["soft"] = f["soft"] and lease.soft
        chosen = [families[family]] if family in families else [] if family else \
            sorted(families.values(), key=lambda f: (-sum(f["pinned_bytes"].values()), f["family"]))[:limit]
        with self._lock:
            refused, expired = dict(self._refused), self._expired
        return {"leases": len({(lease.family, lease.key) for lease in running}), "families": len(families),
                "entries": len({lease.key for lease in running}), "pinned_bytes": self.pinned_bytes(running),
                "caps": dict(self.caps), "refused": refused, "expired": expired,
                "reserved": self.reserved(tenant) if tenant is not None else None,
                "by_family": [f | {"entries": len(f["entries"])} for f in chosen]}


def _why(cap: int, mine: int, adds: int) -> str:
    if cap == 0:
        return "leases are off in this tier (its pinned cap is 0)"
    return f"{adds} bytes more do not fit the tier's pinned cap of {cap} (this tenant pins {mine} there)"
