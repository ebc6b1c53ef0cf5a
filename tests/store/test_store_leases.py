"""Leases (store/leases.py) over a real metadata database (SQLite, and PostgreSQL where replicas matter) and a
real Redis: leased entries survive LRU pressure in every tier and a restart, expire, renew on a hit, stay
within each tier's pinned cap, are shared by stores on one database, and are dropped or released on request;
gc removes entries nobody owns. Time is a clock the test moves (build_store's `clock`), never a sleep."""
from __future__ import annotations

import pytest
import redis
import torch

from common.placement import HOST, Placement
from retrieval import open_metadata
from store import RedisTier, StoreSettings, TieredStore, build_store, encode, family_id
from tests.helpers import assert_same_kv, random_kv
from tests.servers import RedisServer

FP = "model-a"
KV_BYTES = random_kv(0)[1].nbytes  # what an entry takes in the memory tier (every random_kv is this size)
ENTRY_BYTES = len(encode(random_kv(0)[1]))  # ... and on disk


class Clock:
    """The leases' clock, in seconds: moved by the test."""

    def __init__(self) -> None:
        self.now = 1.7e9

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(params=["sqlite"])
def database_url(request, tmp_path) -> str:
    """The ledger's database; tests about replicas run it on PostgreSQL too (`indirect` parametrize)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'metadata.sqlite'}"
    return request.getfixturevalue("postgres_url")


both_databases = pytest.mark.parametrize("database_url", ["sqlite", "postgresql"], indirect=True)


@pytest.fixture
def stores(database_url, tmp_path):
    """open(clock, **settings) -> a store with leases in the test's database; every one closed at the end.
    Settings default to one entry-sized tier of each kind given; the sweeper runs only when a test asks.
    `tenant_shares`: each tenant's reserved share of the pinned caps (none: no tenant has a reservation)."""
    opened = []

    def open_(clock: Clock, placement: Placement = HOST, tenant_shares: dict[str, float] | None = None,
              **settings) -> TieredStore:
        ledger = open_metadata(database_url, tmp_path)
        defaults = {"memory_bytes": 0, "disk_bytes": 0, "read_threads": 0, "lease_refresh_s": 3600.0, "codec": "fp16"}
        store = build_store(StoreSettings(**(defaults | settings)), tmp_path / "kv", FP, placement, ledger=ledger,
                            clock=clock, tenant_shares=tenant_shares)
        opened.append((store, ledger))
        return store
    yield open_
    for store, ledger in opened:
        store.close()
        ledger.close()


TIERS = {"gpu": {"gpu_bytes": 3 * KV_BYTES, "gpu_pinned_bytes": KV_BYTES},
         "memory": {"memory_bytes": 3 * KV_BYTES, "memory_pinned_bytes": KV_BYTES},
         "disk": {"disk_bytes": 3 * ENTRY_BYTES, "disk_pinned_bytes": ENTRY_BYTES}}
OFF_HOST = Placement(torch.device("cpu"), on_host=False)  # a model off the host, its device played by the CPU


def churn(store: TieredStore, start: int = 100, count: int = 10) -> None:
    """Put `count` fresh entries: LRU pressure of several times the tier."""
    for i in range(start, start + count):
        store.put(*random_kv(i))


@pytest.mark.parametrize("tier", ["gpu", "memory", "disk"])
def test_a_leased_entry_survives_lru_pressure_that_evicts_an_unleased_one(stores, tier):
    store = stores(Clock(), OFF_HOST if tier == "gpu" else HOST, **TIERS[tier])
    (leased, kv), (twin, _) = random_kv(0), random_kv(1)  # the same size; the leased one is the older
    store.put(leased, kv)
    store.put(twin, random_kv(1)[1])
    result = store.lease([leased], "client-1", ttl_s=300)
    assert result.complete and result.tiers == (tier,) and result.leased == (leased,)
    assert result.family == family_id("client-1") and "client-1" not in repr(result)
    churn(store)
    assert not store.contains(twin)
    assert_same_kv(store.get(leased), kv)
    stats = store.stats()["tiers"][tier]
    assert stats["lease_held"] > 0 and stats["evictions"] == 12 - 3  # all but the leased one and the last two


def test_leases_outlive_a_restart(stores):
    clock = Clock()
    first = stores(clock, **TIERS["memory"], **TIERS["disk"])
    (leased, kv), (twin, twin_kv) = random_kv(0), random_kv(1)
    first.put(leased, kv)
    first.put(twin, twin_kv)
    assert first.lease([leased], "client-1", ttl_s=300).tiers == ("memory", "disk")
    first.close()

    again = stores(clock, **TIERS["memory"], **TIERS["disk"])  # a new process: same disk dir and database
    assert_same_kv(again.get(leased), kv)  # from disk, promoted into the new memory tier
    churn(again)
    assert again.tiers[0].contains(leased) and again.tiers[1].contains(leased)  # held in both tiers
    assert not again.contains(twin)


def test_an_expired_lease_lets_the_entry_go_and_is_swept(stores):
    clock = Clock()
    store = stores(clock, **TIERS["disk"])
    key, kv = random_kv(0)
    store.put(key, kv)
    store.lease([key], "client-1", ttl_s=60, soft=False)
    clock.advance(61)  # ended: no longer held, even before the sweeper has run
    churn(store)
    assert not store.contains(key)
    assert store.lease_stats()["leases"] == 0
    store.sweep_leases()
    assert store.lease_stats()["expired"] == 1


@both_databases
def test_a_hit_renews_a_soft_lease_not_a_hard_one(stores):
    clock = Clock()
    store = stores(clock, memory_bytes=4 * KV_BYTES, memory_pinned_bytes=2 * KV_BYTES)
    (soft, soft_kv), (hard, hard_kv) = random_kv(0), random_kv(1)
    store.put(soft, soft_kv)
    store.put(hard, hard_kv)
    store.lease([soft], "renewed", ttl_s=100)
    store.lease([hard], "fixed", ttl_s=100, soft=False)
    clock.advance(80)
    assert store.get(soft) is not None and store.get(hard) is not None  # hits: the soft lease runs 100 s again
    clock.advance(80)  # 160 s after both leases: only the renewed one still runs
    churn(store)
    assert store.contains(soft) and not store.contains(hard)

    store.sweep_leases()  # the renewal is written to the database: another store over it sees it
    other = stores(clock, memory_bytes=4 * KV_BYTES)
    running = other.lease_stats()["by_family"]
    assert [(f["family"], f["expires_at"]) for f in running] == [(family_id("renewed"), clock.now - 80 + 100)]


def test_the_pinned_cap_is_held_and_a_refusal_reported(stores):
    store = stores(Clock(), memory_bytes=5 * KV_BYTES, memory_pinned_bytes=2 * KV_BYTES + KV_BYTES // 2,
                   disk_bytes=8 * ENTRY_BYTES, disk_pinned_bytes=8 * ENTRY_BYTES)
    keys = [store.put(*random_kv(i)) is not None and random_kv(i)[0] for i in range(4)]
    first = store.lease(keys[:2], "first", ttl_s=300)
    assert first.complete and first.pinned_bytes["memory"] == 2 * KV_BYTES
    second = store.lease(keys[2:], "second", ttl_s=300)  # two more would pass memory's cap: refused there
    assert second.tiers == ("disk",) and list(second.refused) == ["memory"] and not second.complete
    assert "pinned cap" in second.refused["memory"]
    assert second.pinned_bytes == {"memory": 2 * KV_BYTES, "disk": 4 * ENTRY_BYTES}
    shared = store.lease(keys[:1], "third", ttl_s=300)  # a key already pinned counts once: no more bytes
    assert shared.complete and shared.pinned_bytes["memory"] == 2 * KV_BYTES
    churn(store)
    memory, disk = store.tiers
    assert all(memory.contains(k) for k in keys[:2]) and not any(memory.contains(k) for k in keys[2:])
    assert all(disk.contains(k) for k in keys)
    stats = store.lease_stats()
    assert stats["refused"] == {"memory": 1} and stats["families"] == 3 and stats["entries"] == 4


def test_a_lease_of_missing_keys_and_a_database_outage_are_reported_not_raised(stores, tmp_path):
    store = stores(Clock(), **TIERS["disk"])
    key, kv = random_kv(0)
    absent = random_kv(1)[0]
    store.put(key, kv)
    result = store.lease([key, absent], "client-1", ttl_s=300)
    assert result.leased == (key,) and result.missing == (absent,)
    store._leases.ledger.close()  # the database goes away under the store
    down = store.lease([key], "client-2", ttl_s=300)
    assert down.tiers == () and "ledger failed" in down.refused["disk"]


@both_databases
def test_stores_sharing_a_database_and_disk_honour_each_others_leases(stores):
    clock = Clock()
    one = stores(clock, disk_bytes=4 * ENTRY_BYTES, disk_pinned_bytes=ENTRY_BYTES + ENTRY_BYTES // 2)
    two = stores(clock, disk_bytes=4 * ENTRY_BYTES, disk_pinned_bytes=ENTRY_BYTES + ENTRY_BYTES // 2)
    (key, kv), (other, other_kv) = random_kv(0), random_kv(1)
    one.put(key, kv)
    two.put(other, other_kv)
    assert one.lease([key], "client-1", ttl_s=300).complete
    refused = two.lease([other], "client-2", ttl_s=300)  # the cap is the database's: one's lease fills it
    assert list(refused.refused) == ["disk"]
    two.sweep_leases()  # its view of the shared leases, as its sweeper reads it every lease_refresh_s
    churn(two)  # the other store's puts cull the shared directory
    assert_same_kv(two.get(key), kv)
    assert not one.contains(other)
    assert two.lease_stats()["by_family"][0]["family"] == family_id("client-1")


def test_release_and_drop_family(stores):
    store = stores(Clock(), memory_bytes=8 * KV_BYTES, memory_pinned_bytes=8 * KV_BYTES, **TIERS["disk"] | {
        "disk_bytes": 8 * ENTRY_BYTES, "disk_pinned_bytes": 8 * ENTRY_BYTES})
    document, shared, own = (random_kv(i)[0] for i in range(3))
    for i in range(3):
        store.put(*random_kv(i))
    store.lease([document, shared, own], "family-a", ttl_s=300)
    store.lease([shared], "family-b", ttl_s=300)
    assert store.drop_family("family-a", keep=lambda keys: {document} & set(keys)) == (3, 1)
    assert store.contains(document) and store.contains(shared) and not store.contains(own)
    assert [f["family"] for f in store.lease_stats()["by_family"]] == [family_id("family-b")]
    assert store.drop_family("family-a") == (0, 0)  # nothing left to drop
    assert store.release("family-b") == 1 and store.contains(shared)  # ended; the entry stays, under LRU
    assert store.lease_stats()["leases"] == 0


def test_tenants_families_are_their_own_and_each_pins_within_its_reservation(stores):
    store = stores(Clock(), memory_bytes=8 * KV_BYTES, memory_pinned_bytes=4 * KV_BYTES,
                   tenant_shares={"alice": 0.5, "bob": 0.5})
    keys = [random_kv(i)[0] for i in range(4)]
    for i in range(4):
        store.put(*random_kv(i))
    # one family name, two tenants: two families, each seen and dropped by its own tenant alone
    alice = store.lease(keys[:1], "team", ttl_s=300, tenant="alice")
    bob = store.lease(keys[1:2], "team", ttl_s=300, tenant="bob")
    assert alice.complete and bob.complete and alice.family != bob.family != family_id("team")
    assert [f["family"] for f in store.lease_stats(tenant="alice")["by_family"]] == [alice.family]
    assert store.lease_stats("team", tenant="bob")["by_family"][0]["family"] == bob.family
    assert store.lease_stats(tenant="")["families"] == 0  # the default tenant's: none
    # alice's reservation is half the cap (2 entries) and nothing is left unreserved: one more fits, two more not
    assert store.lease(keys[2:3], "more", ttl_s=300, tenant="alice").complete
    over = store.lease(keys[3:], "most", ttl_s=300, tenant="alice")
    assert list(over.refused) == ["memory"] and "tenant's reservation" in over.refused["memory"]
    assert store.lease(keys[3:], "most", ttl_s=300, tenant="bob").complete
    assert store.drop_family("team", tenant="bob") == (1, 1)  # bob's own: alice's "team" stays
    assert store.contains(keys[0]) and store.lease_stats(tenant="alice")["families"] == 2


def test_each_tenant_may_always_pin_its_reservation_and_shares_the_rest_first_come(stores):
    """The issue's case: a tenant's first lease within its reservation is granted however much the others pinned
    (the default tenant's too); past its reservation a tenant takes room no tenant reserved, first come; a refusal
    quotes the caller's own pins and reservation alone."""
    shares = {"alice": 0.25, "bob": 0.25, "carol": 0.25, "": 0.125}  # 2, 2, 2 and 1 entries of 8; 1 left unreserved
    store = stores(Clock(), memory_bytes=16 * KV_BYTES, memory_pinned_bytes=8 * KV_BYTES, tenant_shares=shares)
    keys = [random_kv(i)[0] for i in range(9)]
    for i in range(9):
        store.put(*random_kv(i))
    assert store.lease(keys[:3], "a", ttl_s=300, tenant="alice").complete  # past its 2: the unreserved one
    assert list(store.lease(keys[3:4], "a2", ttl_s=300, tenant="alice").refused) == ["memory"]
    # 3 of 8 pinned, yet a tenant with no reservation finds no room: the rest is reserved to the others
    stranger = store.lease(keys[3:4], "s", ttl_s=300, tenant="mallory").refused["memory"]
    assert f"reservation of 0 bytes of the tier's pinned cap of {8 * KV_BYTES} (0 pinned already)" in stranger
    assert store.lease(keys[3:5], "b", ttl_s=300, tenant="bob").complete
    assert store.lease(keys[5:7], "c", ttl_s=300, tenant="carol").complete  # the first lease after two others'
    assert store.lease(keys[7:8], "d", ttl_s=300).complete  # the default tenant's reservation is its own too
    assert store.lease_stats()["pinned_bytes"]["memory"] == 8 * KV_BYTES  # the whole cap, every tenant in it
    why = store.lease(keys[8:], "b2", ttl_s=300, tenant="bob").refused["memory"]
    assert f"reservation of {2 * KV_BYTES} bytes" in why and f"({2 * KV_BYTES} pinned already)" in why
    assert str(3 * KV_BYTES) not in why and str(6 * KV_BYTES) not in why  # alice's pins, the others' together
    assert store.lease_stats(tenant="carol")["reserved"] == {"memory": 2 * KV_BYTES}
    assert store.release("a", tenant="alice") == 3  # alice's unreserved entry is free again: bob may take it
    assert store.lease(keys[8:], "b2", ttl_s=300, tenant="bob").complete


def test_tenants_shares_past_the_whole_cap_are_scaled_down_evenly(stores):
    store = stores(Clock(), memory_bytes=8 * KV_BYTES, memory_pinned_bytes=6 * KV_BYTES,
                   tenant_shares={"alice": 0.5, "bob": 0.5, "": 0.5})
    assert all(store.lease_stats(tenant=t)["reserved"] == {"memory": 2 * KV_BYTES} for t in ("alice", "bob", ""))


def test_a_leased_redis_entry_keeps_no_ttl_until_its_last_lease_ends(stores, redis_url):
    store = stores(Clock(), redis_url=redis_url, redis_ttl_s=600)
    key, kv = random_kv(0)
    raw = redis.Redis.from_url(redis_url)
    store.put(key, kv)
    store.flush()
    assert 0 < raw.ttl("ragblend:" + key) <= 600
    assert store.lease([key], "a", ttl_s=300).tiers == ("redis",) and store.lease([key], "b", ttl_s=300).complete
    assert raw.ttl("ragblend:" + key) == -1  # no TTL: never aged out, nor a candidate of a volatile-* policy
    store.put(key, kv)  # written again while leased: still none
    store.flush()
    assert raw.ttl("ragblend:" + key) == -1
    store.release("a")
    assert raw.ttl("ragblend:" + key) == -1  # b still holds it
    store.release("b")
    assert 0 < raw.ttl("ragblend:" + key) <= 600


def test_redis_memory_pressure_evicts_the_unleased_entry_never_the_leased_one(stores):
    # volatile-lru: Redis evicts only keys with a TTL, and a leased entry has none. (Under allkeys-lru it
    # could evict either: store/redis_tier.py says so.) The pressure is other keys without a TTL, so the
    # unleased entry is the one candidate: which key goes does not depend on Redis's sampling.
    with RedisServer(maxmemory="3mb", policy="volatile-lru") as server:
        store = stores(Clock(), redis_url=server.url, redis_ttl_s=600)
        (leased, kv), (twin, twin_kv) = random_kv(0), random_kv(1)
        store.put(leased, kv)
        store.put(twin, twin_kv)
        store.flush()
        assert store.lease([leased], "client-1", ttl_s=300).tiers == ("redis",)
        with server.client() as raw:
            for i in range(200):
                try:
                    raw.set(f"other:{i}", b"x" * 65536)
                except redis.ResponseError:  # OOM: nothing with a TTL is left to evict
                    break
            assert not raw.exists("ragblend:" + twin) and raw.info("stats")["evicted_keys"] >= 1
        assert_same_kv(store.get(leased), kv)


def test_a_leased_redis_entry_outlives_a_restart_of_the_store_and_memory_pressure(tmp_path):
    # The lease is in the database: a new process (a new store over the same database and Redis) writes the
    # leased entry again without a TTL, and Redis's volatile-lru (docker-compose's) still passes over it.
    with RedisServer(maxmemory="3mb", policy="volatile-lru") as server:
        database = open_metadata(f"sqlite:///{tmp_path / 'metadata.sqlite'}", tmp_path)
        settings = StoreSettings(memory_bytes=0, disk_bytes=0, read_threads=0, lease_refresh_s=3600.0,
                                 redis_url=server.url, redis_ttl_s=600)
        (leased, kv), (twin, twin_kv) = random_kv(0), random_kv(1)
        first = build_store(settings, None, FP, HOST, ledger=database, clock=Clock())
        first.put(leased, kv)
        first.flush()
        assert first.lease([leased], "client-1", ttl_s=3600).tiers == ("redis",)
        first.close()

        again = build_store(settings, None, FP, HOST, ledger=database, clock=Clock())
        again.put(leased, kv)  # written again by the new process: still no TTL
        again.put(twin, twin_kv)
        again.flush()
        with server.client() as raw:
            assert raw.ttl("ragblend:" + leased) == -1 and raw.ttl("ragblend:" + twin) > 0
            for i in range(200):
                try:
                    raw.set(f"other:{i}", b"x" * 65536)
                except redis.ResponseError:  # OOM: nothing with a TTL is left to evict
                    break
            assert not raw.exists("ragblend:" + twin)
        assert_same_kv(again.get(leased), kv, settings.codec_of("redis"))  # the default codec of a Redis tier
        again.close()
        database.close()


def test_gc_removes_entries_nobody_owns_and_keeps_the_rest(stores, redis_url):
    store = stores(Clock(), disk_bytes=1 << 20, disk_pinned_bytes=1 << 20, redis_url=redis_url)
    owned, leased, orphan = (random_kv(i)[0] for i in range(3))
    other_model = random_kv(3, fingerprint="model-b")
    for i in range(3):
        store.put(*random_kv(i))
    RedisTier(redis_url).put_bytes(other_model[0], encode(other_model[1]))  # another deployment's, in Redis
    store.flush()
    store.lease([leased], "client-1", ttl_s=300)

    def owner(keys: list[str]) -> set[str]:
        return {owned} & set(keys)

    recent = store.gc(FP, owned=owner)  # everything was used just now: kept
    assert recent["disk"]["orphans"]["removed"] == recent["redis"]["orphans"]["removed"] == 0
    assert recent["disk"]["orphans"]["kept_recent"] == 1 and recent["redis"]["orphans"]["kept_recent"] == 2
    report = store.gc(FP, owned=owner, min_idle_s=0)
    assert report["disk"]["orphans"] == {"removed": 1, "removed_bytes": ENTRY_BYTES, "kept_owned": 1,
                                         "kept_leased": 1, "kept_recent": 0, "kept_other_model": 0}
    assert report["redis"]["orphans"]["removed"] == 1 and report["redis"]["orphans"]["kept_other_model"] == 1
    assert store.contains(owned) and store.contains(leased) and not store.contains(orphan)
    assert RedisTier(redis_url).contains(other_model[0])
