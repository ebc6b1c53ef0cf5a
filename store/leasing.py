"""The store's side of leases (store/leases.py is the book and its API): granting over the tiers' sizes, release,
drop, stats, and the sweep that housekeeping runs every `refresh_s` (common/housekeeping.py), behind TieredStore."""
from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

from store.admission import TENSOR_TIERS, Admission
from store.base import Tier
from store.leases import Freed, LeaseResult, Leases, family_id
from store.lookup import Lookup
from store.writer import Writer

log = logging.getLogger("ragblend.store")


class Leasing:
    """Leases over `tiers`: the book (`leases`), the writer (a request's spans may still be on their way) and the
    lookup (an entry's size where a tier lacks it)."""

    def __init__(self, leases: Leases, tiers: Sequence[Tier], writer: Writer, lookup: Lookup,
                 admission: Admission) -> None:
        self.leases, self.tiers, self._writer, self._lookup, self._admission = leases, list(tiers), writer, lookup, \
            admission
        self._failing = False  # the last sweep failed (logged once until one succeeds)

    def holds(self, key: str) -> bool:
        """Whether a running lease holds `key` in any tier."""
        return any(self.leases.holds(t.name, key) for t in self.tiers)

    def lease(self, keys: Iterable[str], family: str, ttl_s: float, soft: bool = True,
              tenant: str = "") -> LeaseResult:
        """TieredStore.lease: `keys` are valid store keys."""
        if not ttl_s > 0:
            raise ValueError(f"a lease's ttl_s must be > 0, got {ttl_s}")
        family = family_id(family, tenant)
        keys = list(dict.fromkeys(keys))
        if any(self._writer.pending(key) is not None for key in keys):
            self._writer.flush()  # a request's spans may still be on their way to the tiers (off the model thread)
        sizes: dict[str, dict[str, int]] = {}
        missing: list[str] = []
        for key in keys:
            found = self._sizes(key)
            if found is None:
                missing.append(key)
            else:
                sizes[key] = found
        if not sizes:
            return LeaseResult(family, (), tuple(missing), (), {}, None, self.leases.pinned_bytes())
        try:
            result = self.leases.grant(family, sizes, missing, ttl_s, soft)
        except Exception as exc:  # the database is down: the request still answers, unleased
            log.warning("store: lease not granted: %s: %s", type(exc).__name__, exc)
            why = f"the lease ledger failed ({type(exc).__name__})"
            return LeaseResult(family, (), tuple(missing), (), dict.fromkeys(self.leases.caps, why), None,
                               self.leases.pinned_bytes())
        for tier in self.tiers:
            if tier.name in result.tiers:
                tier.on_lease(result.leased, held=True)
        for key in result.leased if self._admission.filters else ():
            self._write_down_leased(key)
        return result

    def _write_down_leased(self, key: str) -> None:
        """A leased key is admitted everywhere: queue the tensors a tier holds for the tiers below (a pending
        write of it needs nothing: it asks about leases when it runs)."""
        if self._writer.pending(key) is None:
            found_at = next((i for i, t in enumerate(self.tiers) if t.name in TENSOR_TIERS and t.contains(key)), None)
            if found_at is not None:
                self._writer.write_down(key, found_at)

    def _sizes(self, key: str) -> dict[str, int] | None:
        """The bytes the entry takes (or would take) in each tier with a pinned cap; None if no tier holds
        it. The entry is read only when some tier lacks it (e.g. a Redis write still queued)."""
        tiers = [t for t in self.tiers if t.name in self.leases.caps]
        sizes = {t.name: t.size_of(key) for t in tiers}
        if all(n is None for n in sizes.values()) and self._writer.pending(key) is None:
            return None
        if any(n is None for n in sizes.values()):
            entry = self._lookup.any_entry(key)
            if entry is None:
                return None
            sizes = {t.name: t.footprint(entry) if sizes[t.name] is None else sizes[t.name] for t in tiers}
        return sizes

    def release(self, family: str, tenant: str = "") -> int:
        """End the family's leases now; the number of entries they held (they stay, under LRU)."""
        freed = self.leases.release(family_id(family, tenant))
        self._unpinned(freed)
        return len({key for key, _, _ in freed})

    def drop_family(self, family: str, keep: Callable[[list[str]], Collection[str]], tenant: str,
                    delete: Callable[[str], bool]) -> tuple[int, int]:
        """TieredStore.drop_family, deleting with `delete(key)`."""
        freed = self.leases.release(family_id(family, tenant))
        self._unpinned(freed)
        keys = sorted({key for key, _, _ in freed})
        if not keys:
            return 0, 0
        kept = set(keep(keys)) | self.leases.leased_keys()
        return len(keys), sum(delete(key) for key in keys if key not in kept)

    def stats(self, family: str | None = None, limit: int = 100, tenant: str | None = None) -> dict[str, Any]:
        return self.leases.stats(family_id(family, tenant or "") if family else None, limit, tenant)

    def sweep(self) -> None:
        """One sweeper pass now: renewals written, ended leases deleted (Redis TTLs given back), the snapshot read
        again."""
        self._unpinned(self.leases.sweep())

    def sweep_quietly(self) -> None:
        """`sweep` as housekeeping runs it: a database outage is logged once; the snapshot stands until it is
        back."""
        try:
            self.sweep()
        except Exception as exc:
            log.log(logging.DEBUG if self._failing else logging.WARNING, "store: lease sweep failed: %s: %s",
                    type(exc).__name__, exc)
            self._failing = True
        else:
            self._failing = False

    def _unpinned(self, freed: list[Freed]) -> None:
        """Tell each tier which keys the last lease there let go."""
        for tier in self.tiers:
            if keys := [key for key, name, still in freed if name == tier.name and not still]:
                tier.on_lease(keys, held=False)
