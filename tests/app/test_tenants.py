"""Tenants against a real server (the embedded model): API keys map to tenants (server.api_keys, also as JSON in
RAGBLEND_SERVER__API_KEYS); one tenant's leases and cache views are its own; requests are counted by tenant."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from app.config import ServerSettings, load_settings
from store import family_id
from tests.helpers import MODEL

pytestmark = pytest.mark.slow

KEYS = {"key-alice": "alice", "key-bob": "bob"}
ALICE, BOB = ({"Authorization": f"Bearer {key}"} for key in KEYS)
ADMIN = {"Authorization": "Bearer key-admin"}


def test_api_keys_come_from_the_environment_as_json(monkeypatch):
    monkeypatch.setenv("RAGBLEND_SERVER__API_KEYS", '{"key-alice": "alice", "key-bob": "bob"}')
    settings = load_settings(server={"api_key": "old"})
    assert settings.server.tenant_keys() == {"old": "", **KEYS}
    assert settings.server.tenant_shares() == {"": 0.5, "alice": 0.5, "bob": 0.5}  # the default tenant's too
    assert ServerSettings().tenant_shares() == {"": 0.5}  # no keys: the default tenant alone


def test_each_tenant_sees_its_reservation_of_the_pinned_caps(engine_with):
    """server.tenant_pinned_share reaches the store a server builds: each tenant's /v1/cache says its reservation."""
    from app.api.server import create_app

    settings, engine = engine_with(server={"api_keys": KEYS, "admin_keys": ["key-admin"], "tenant_pinned_share": 0.25})
    with TestClient(create_app(settings, engine)) as client:
        caps = {name: t["pinned_cap"] for name, t in client.get("/v1/cache", headers=ADMIN).json()["tiers"].items()}
        assert caps and all(cap > 0 for cap in caps.values())
        for headers in (ALICE, BOB):
            mine = client.get("/v1/cache", headers=headers).json()["tiers"]
            assert {name: t["pinned_cap"] for name, t in mine.items()} == {n: int(cap / 4) for n, cap in caps.items()}


@pytest.fixture
def tenants(make_app, corpus, server_engine):
    with TestClient(make_app(server={"api_keys": KEYS, "admin_keys": ["key-admin"]})) as client:
        yield client
    for tenant in KEYS.values():  # the session's store is shared: end what the test leased
        server_engine.parts.store.release("secret plans", tenant=tenant)


def chat(client: TestClient, headers: dict, text: str) -> dict:
    response = client.post("/v1/chat/completions", headers=headers, json={
        "model": MODEL, "max_tokens": 1, "retrieval": False, "prompt_cache_key": "secret plans",
        "prompt_cache_retention": "24h", "messages": [{"role": "system", "content": "Be brief (tenants)."},
                                                      {"role": "user", "content": text}]})
    assert response.status_code == 200, response.text
    return response.json()


def test_a_tenant_sees_and_drops_only_its_own_families(tenants):
    assert tenants.get("/v1/cache", headers={"Authorization": "Bearer nope"}).status_code == 401
    lease = chat(tenants, ALICE, "My secret: the vault code is 4471. Who built the lighthouse?")["lease"]
    assert lease["status"] == "held" and lease["family"] == family_id("secret plans", "alice")

    mine = tenants.get("/v1/cache", headers=ALICE, params={"prompt_cache_key": "secret plans"}).json()
    assert [f["family"] for f in mine["data"]] == [lease["family"]] and mine["families"] >= 1
    theirs = tenants.get("/v1/cache", headers=BOB).json()  # bob sees none of alice's families
    assert theirs["families"] == theirs["leases"] == 0 and theirs["data"] == []
    assert tenants.get("/v1/cache", headers=BOB, params={"prompt_cache_key": "secret plans"}).json()["data"] == []

    # bob dropping a family of the same name drops his own (none), never alice's
    dropped = tenants.delete("/v1/cache", headers=BOB, params={"prompt_cache_key": "secret plans"}).json()
    assert dropped["leases_ended"] == 0 and dropped["family"] == family_id("secret plans", "bob")
    again = tenants.get("/v1/cache", headers=ALICE, params={"prompt_cache_key": "secret plans"}).json()
    assert again["data"] and again["data"][0]["entries"] == mine["data"][0]["entries"]
    ended = tenants.delete("/v1/cache", headers=ALICE, params={"prompt_cache_key": "secret plans"}).json()
    assert ended["leases_ended"] == mine["data"][0]["entries"] > 0

    assert tenants.get("/metrics", headers=ALICE).status_code == 403  # every tenant's counts: an admin's
    metrics = tenants.get("/metrics", headers=ADMIN).text
    assert 'endpoint="/v1/chat/completions",status="200",tenant="alice"' in metrics
    assert 'endpoint="/v1/cache",status="401",tenant="default"' in metrics


def test_a_tenant_reads_its_own_counters_and_an_admin_the_stores(tenants, corpus):
    """/v1/cache: a tenant's view counts the chunks its own requests read, and none of the store-wide figures
    (entries, bytes, evictions, refusals, another tenant's hits); an admin key sees the store's."""
    question = corpus.questions[1][0]
    assert tenants.post("/v1/query", headers=BOB, json={"question": question, "max_tokens": 1}).status_code == 200
    bob, alice = (tenants.get("/v1/cache", headers=h).json() for h in (BOB, ALICE))
    admin = tenants.get("/v1/cache", headers=ADMIN).json()
    read = sum(tier["hits"] for tier in bob["tiers"].values())
    assert read >= 1 and bob["hit_rate"] is not None  # bob's passages came from the store
    assert sum(tier["hits"] for tier in alice["tiers"].values()) == 0 and alice["hit_rate"] is None
    for view in (bob, alice):
        assert all(t["entries"] is None and t["bytes"] is None and t["misses"] is None and t["evictions"] is None
                   and t["lease_refusals"] is None for t in view["tiers"].values())
    assert all(t["misses"] is not None and t["lease_refusals"] is not None for t in admin["tiers"].values())
    assert sum(t["hits"] for t in admin["tiers"].values()) >= read


def test_a_tenant_cannot_tell_whether_another_sent_a_message(tenants):
    secret = "My secret: the vault code is 9912. Who founded the bakery?"
    chat(tenants, ALICE, secret)
    body = {"messages": [{"role": "system", "content": "Be brief (tenants)."}, {"role": "user", "content": secret},
                         {"role": "assistant", "content": "x"}, {"role": "user", "content": "and?"}],
            "retrieval": False}
    mine = tenants.post("/v1/cache/lookup", headers=ALICE, json=body).json()
    theirs = tenants.post("/v1/cache/lookup", headers=BOB, json=body).json()
    assert mine["pieces"][1]["cached"] is not None  # alice's own message: stored
    assert theirs["pieces"][1]["cached"] is None  # bob cannot tell it was ever sent
