"""Tenants against a real server (the embedded model): API keys map to tenants (server.api_keys, also as JSON in
RAGBLEND_SERVER__API_KEYS); one tenant's leases and cache views are its own; requests are counted by tenant."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from app.config import load_settings
from store import family_id
from tests.helpers import MODEL

pytestmark = pytest.mark.slow

KEYS = {"key-alice": "alice", "key-bob": "bob"}
ALICE, BOB = ({"Authorization": f"Bearer {key}"} for key in KEYS)


def test_api_keys_come_from_the_environment_as_json(monkeypatch):
    monkeypatch.setenv("RAGBLEND_SERVER__API_KEYS", '{"key-alice": "alice", "key-bob": "bob"}')
    settings = load_settings(server={"api_key": "old"})
    assert settings.server.tenant_keys() == {"old": "", **KEYS}


@pytest.fixture
def tenants(make_app, corpus, server_engine):
    with TestClient(make_app(server={"api_keys": KEYS})) as client:
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

    metrics = tenants.get("/metrics", headers=ALICE).text
    assert 'endpoint="/v1/chat/completions",status="200",tenant="alice"' in metrics
    assert 'endpoint="/v1/cache",status="401",tenant="default"' in metrics


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
