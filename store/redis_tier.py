"""Shared tier: serialized entries in Redis, so replicas reuse each other's KV.

Redis is an optimisation, never a dependency: a connection error or timeout is a miss (or a
dropped write), counted in stats and logged once per outage. After a failure the tier is skipped
for `backoff_s`, so a dead Redis costs one timeout per back-off window rather than one per
request; the first call after the window retries, and redis-py reconnects by itself.
Capacity and eviction are Redis's business: run it with a `maxmemory` and an LRU (or LFU)
policy, e.g. `--maxmemory 8gb --maxmemory-policy volatile-lru` with `ttl_s` set (docker-compose.yml: it
never evicts a leased entry, see below). An evicted entry is a miss like
any other: the KV is recomputed and put back. `stats()` reports the server's memory, limit,
policy and evictions.

Leases (store/leases.py). Redis has no pinning of its own, so a leased entry is kept from aging
out: while a lease holds it here it carries no TTL (PERSIST; a put of it sets none), and when the last
lease on it ends it gets `ttl_s` again, from then. That is "a TTL at least as long as the lease". What
Redis's own maxmemory policy can still do to a leased entry: under `allkeys-lru`/`allkeys-lfu`/
`allkeys-random` (the suggestion above) it may evict it when memory runs out, like any key (a miss:
recomputed and put back, still leased); under a `volatile-*` policy with `ttl_s` set it never does,
since only keys with a TTL are candidates (but Redis then refuses writes once the leased entries alone
fill it); under `noeviction` nothing is evicted and writes fail when full. `store.redis_pinned_bytes`
caps the bytes leases keep from aging here. Another replica's put of a leased entry within its lease
refresh (store.lease_refresh_s) of the grant may still set the TTL.

Puts go through the tier's own write-behind thread (`ragblend-store-writer`, a bounded queue of
`queue_size`: a full queue drops the write, counted), so a request never waits on Redis; a delete wins
over the writes of its key queued before it. Upkeep is Redis's own: `gc` leaves it alone.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from store.byte_tier import ByteTier
from store.eviction import Pinned, never_pinned
from store.keys import is_key, validate_key
from store.serialize import OPEN_BYTES

log = logging.getLogger("ragblend.store")
T = TypeVar("T")
_GLOB_SPECIAL = "\\*?[]"


PREFETCH_BYTES = OPEN_BYTES  # read when an entry is opened: the store's first read of its head


class RedisReader:
    """Byte ranges of one Redis entry by GETRANGE. A range that comes back short means the key
    went away (deleted, expired, evicted) or Redis is unreachable; the caller checks lengths."""

    def __init__(self, tier: RedisTier, name: str, first: bytes) -> None:
        self._tier, self._name, self._first = tier, name, first

    def read(self, offset: int, length: int) -> bytes:
        if offset + length <= len(self._first) or len(self._first) < PREFETCH_BYTES:
            return self._first[offset:offset + length]  # a short first read was the whole value
        return self._tier._getrange(self._name, offset, length)

    def close(self) -> None:
        pass


class RedisTier(ByteTier):
    name = "redis"

    def __init__(self, url: str, password: str | None = None, prefix: str = "ragblend:",
                 ttl_s: int | None = None, timeout_s: float = 0.5, backoff_s: float = 5.0,
                 queue_size: int = 256, pinned: Pinned = never_pinned) -> None:
        """`pinned`: the keys leases hold here (their entries get no TTL; see the module doc)."""
        extra = {} if password is None else {"password": password}
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            # A dropped connection (server restarted, idle timeout) gets one immediate reconnect;
            # a timeout gets none: a hung server must cost one timeout, not several.
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
            **extra)
        kw = self._client.connection_pool.connection_kwargs
        self.where = f"{kw.get('host', kw.get('path'))}:{kw.get('port', '')}/{kw.get('db', 0)}"  # no password
        self.prefix, self.ttl_s, self.backoff_s, self.pinned = prefix, ttl_s, backoff_s, pinned
        self._lock = threading.Lock()
        self._down_until = 0.0  # time.monotonic() before which Redis is skipped
        self._up = True
        self._errors = self._outages = self._skipped = 0
        super().__init__(write_behind=queue_size)  # last: its thread starts only once the tier can write

    def _name(self, key: str) -> str:
        return self.prefix + validate_key(key)

    def _call(self, default: T, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run one Redis command; on trouble count it, back off if the server is unreachable."""
        if time.monotonic() < self._down_until:
            with self._lock:
                self._skipped += 1
            return default
        try:
            result = fn(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            self._went_down(exc)
            return default
        except redis.RedisError as exc:  # the server answered with an error (e.g. OOM): no back-off
            with self._lock:
                self._errors += 1
            log.debug("redis tier: %s", exc)
            return default
        if not self._up:
            self._came_back()
        return result

    def _went_down(self, exc: Exception) -> None:
        with self._lock:
            self._errors += 1
            self._down_until = time.monotonic() + self.backoff_s
            if not self._up:
                return
            self._up = False
            self._outages += 1
        log.warning("redis tier: %s unreachable (%s); serving from the other tiers, retrying every %.1fs",
                    self.where, exc, self.backoff_s)

    def _came_back(self) -> None:
        with self._lock:
            was_up, self._up = self._up, True
        if not was_up:
            log.warning("redis tier: %s is back", self.where)

    def get_bytes(self, key: str) -> bytes | None:
        return self._call(None, self._client.get, self._name(key))

    def head(self, key: str, nbytes: int) -> bytes | None:
        return self._call(None, self._client.getrange, self._name(key), 0, nbytes - 1) or None

    def reader(self, key: str) -> RedisReader | None:
        """Open an entry for byte-range reads: one GETRANGE of its first bytes, kept for the
        header, then one GETRANGE per range (the entry stays one key, so a put stays atomic and an
        eviction takes all of it or nothing). None if the key is absent or Redis is unreachable."""
        name = self._name(key)
        first = self._call(b"", self._client.getrange, name, 0, PREFETCH_BYTES - 1)
        return RedisReader(self, name, first) if first else None

    def _getrange(self, name: str, offset: int, length: int) -> bytes:
        return self._call(b"", self._client.getrange, name, offset, offset + length - 1) if length > 0 else b""

    def put_bytes(self, key: str, data: bytes) -> None:
        ttl = None if self.pinned(key) else self.ttl_s
        self._call(None, self._client.set, self._name(key), data, ex=ttl or None)

    def on_lease(self, keys: Sequence[str], held: bool) -> None:
        """Lift the TTL of entries a lease now holds; give it back to those the last lease let go."""
        if not self.ttl_s or not keys:
            return

        def apply() -> None:
            with self._client.pipeline(transaction=False) as pipe:
                for key in keys:
                    if held:
                        pipe.persist(self._name(key))
                    else:
                        pipe.expire(self._name(key), self.ttl_s)
                pipe.execute()
        self._call(None, apply)

    def size_of(self, key: str) -> int | None:
        return self._call(0, self._client.strlen, self._name(key)) or None

    def idle_s(self, key: str) -> float | None:
        """OBJECT IDLETIME: None for an absent key, or under an LFU policy (Redis then keeps no idle time)."""
        idle = self._call(None, self._client.object, "idletime", self._name(key))
        return None if idle is None else float(idle)

    def remove(self, key: str) -> bool:
        return bool(self._call(0, self._client.delete, self._name(key)))

    def contains(self, key: str) -> bool:
        return bool(self._call(0, self._client.exists, self._name(key)))

    def keys(self) -> Iterator[str]:
        pattern = "".join("\\" + c if c in _GLOB_SPECIAL else c for c in self.prefix) + "*"
        names = self._call([], lambda: list(self._client.scan_iter(match=pattern, count=1000)))
        n = len(self.prefix)
        return (key for name in names if is_key(key := name.decode(errors="replace")[n:]))

    def gc(self, keep_fingerprint: str) -> None:
        """Nothing: replicas share Redis and may run another model; its TTL and maxmemory policy age entries out."""
        return None

    def close(self) -> None:
        super().close()  # the queued writes first
        self._client.close()

    def stats(self) -> dict[str, Any]:
        """Ours: errors, outages, skipped calls, the write queue's length and its dropped writes. The server's (None
        when unreachable): keys in this database, memory used and its limit and policy, evictions since it started."""
        info = self._call({}, self._client.info)
        keys = info.get(f"db{self._client.connection_pool.connection_kwargs.get('db', 0)}", {}).get("keys")
        with self._lock:
            return {"entries": keys, "bytes": info.get("used_memory"), "evictions": info.get("evicted_keys"),
                    "maxmemory": info.get("maxmemory"), "policy": info.get("maxmemory_policy"),
                    "errors": self._errors, "outages": self._outages, "skipped": self._skipped,
                    "available": self._up and time.monotonic() >= self._down_until, **self.write_stats()}
