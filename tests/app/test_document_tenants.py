"""Documents per tenant (retrieval.documents: tenant) against a real server (the embedded model): a tenant lists,
gets, deletes and retrieves only its own documents, another's are a 404 like a missing one, the same id lives in
both, and their passages' KV entries are keyed apart. With `shared` (the default) every tenant sees one collection."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tests.helpers import MODEL

pytestmark = pytest.mark.slow

KEYS = {"key-alice": "alice", "key-bob": "bob"}
ALICE, BOB = ({"Authorization": f"Bearer {key}"} for key in KEYS)
VAULT = "The Zorvath vault code is 4471. Only the night warden of Zorvath knows it."
GARDEN = "The Zorvath garden has three quince trees and a well that never freezes."


@pytest.fixture
def per_tenant(make_app, corpus, server_engine):
    with TestClient(make_app(server={"api_keys": KEYS}, retrieval={"documents": "tenant"})) as client:
        yield client
        for tenant, headers in (("alice", ALICE), ("bob", BOB)):  # the session's index is shared: leave it clean
            for doc in server_engine.parts.retriever.list_documents(tenant):
                client.delete(f"/v1/documents/{doc.id}", headers=headers)


def upload(client: TestClient, headers: dict, doc_id: str, title: str, text: str) -> dict:
    response = client.post("/v1/documents", headers=headers, json={"id": doc_id, "title": title, "text": text})
    assert response.status_code == 201, response.text
    return response.json()["data"][0]


def ask(client: TestClient, headers: dict, question: str) -> dict:
    response = client.post("/v1/query", headers=headers, json={"question": question, "top_k": 4, "max_tokens": 1})
    assert response.status_code == 200, response.text
    return response.json()


def test_tenants_see_fetch_delete_and_retrieve_only_their_own_documents(per_tenant, corpus, server_engine):
    assert upload(per_tenant, ALICE, "plans", "Alice plans", VAULT)["status"] == "added"
    assert upload(per_tenant, BOB, "plans", "Bob plans", GARDEN)["status"] == "added"  # the same id: bob's own
    upload(per_tenant, ALICE, "diary", "Alice diary", "The night warden of Zorvath is Quill Amsel.")

    listed = {who: [(d["id"], d["title"]) for d in per_tenant.get("/v1/documents", headers=h).json()["data"]]
              for who, h in (("alice", ALICE), ("bob", BOB))}
    assert listed == {"alice": [("diary", "Alice diary"), ("plans", "Alice plans")], "bob": [("plans", "Bob plans")]}
    assert per_tenant.get("/v1/documents/plans", headers=BOB).json()["title"] == "Bob plans"
    assert per_tenant.get(f"/v1/documents/{next(iter(corpus.docs))}", headers=ALICE).status_code == 404  # shared

    # bob asking for alice's diary is told exactly what a document that exists nowhere tells him
    theirs, missing = (per_tenant.get(f"/v1/documents/{doc_id}", headers=BOB) for doc_id in ("diary", "nowhere"))
    assert theirs.status_code == missing.status_code == 404
    assert theirs.json()["error"]["code"] == missing.json()["error"]["code"] == "not_found"
    deleted = per_tenant.delete("/v1/documents/diary", headers=BOB)
    assert deleted.status_code == 404 and deleted.json()["error"]["code"] == "not_found"
    assert per_tenant.get("/v1/documents/diary", headers=ALICE).status_code == 200  # still there

    question = "What is the vault code of Zorvath and who is the night warden?"
    mine = ask(per_tenant, ALICE, question)
    assert {s["doc_id"] for s in mine["sources"]} == {"plans", "diary"}
    assert all(s["title"].startswith("Alice") for s in mine["sources"])
    # alice's passages were found in the store under her collection's keys, as her upload stored them: read, or
    # (planner.by_cost) found and priced cheaper to compute with the question, a few dozen tokens each
    found = mine["stats"]["plan"] is not None and not mine["stats"]["plan"]["blend"]
    assert found or (mine["stats"]["store_hits"] and "computed" not in mine["stats"]["store_hits"])
    bobs = ask(per_tenant, BOB, question)
    assert [(s["doc_id"], s["title"]) for s in bobs["sources"]] == [("plans", "Bob plans")]
    assert "4471" not in str(bobs)
    chat = per_tenant.post("/v1/chat/completions", headers=BOB, json={
        "model": MODEL, "max_tokens": 1, "retrieval": True, "messages": [{"role": "user", "content": question}]})
    assert chat.status_code == 200, chat.text
    assert [s["title"] for s in chat.json()["sources"]] == ["Bob plans"]

    assert per_tenant.delete("/v1/documents/plans", headers=ALICE).status_code == 200
    assert per_tenant.get("/v1/documents/plans", headers=BOB).json()["title"] == "Bob plans"  # bob's stays
    assert [s["doc_id"] for s in ask(per_tenant, ALICE, question)["sources"]] == ["diary"]


def test_the_same_text_in_two_tenants_has_two_kv_entries(per_tenant, server_engine):
    """A tenant's passage KV is keyed by its collection: bob uploading alice's text finds nothing of hers (no hit
    that would tell him it exists) and deleting his leaves hers."""
    parts = server_engine.parts
    upload(per_tenant, ALICE, "same", "Shared words", VAULT)
    key_alice = parts.retriever.document_chunks("same", "alice")[0].kv_key
    chunk = parts.retriever.document_chunks("same", "alice")[0]
    key_bob = parts.kv_cache.key(parts.kv_cache.passage_ids(chunk.token_ids, "Shared words"), "bob")
    assert key_bob != key_alice and parts.store.contains(key_alice) and not parts.store.contains(key_bob)
    lookup = per_tenant.post("/v1/cache/lookup", headers=ALICE, json={"prompt": "What is the Zorvath vault code?"})
    passages = [p for p in lookup.json()["pieces"] if p["kind"] == "passage"]
    assert passages[0]["cached"] == "exact"  # her entry's key is salted, yet it was computed right there
    upload(per_tenant, BOB, "same", "Shared words", VAULT)
    assert parts.retriever.document_chunks("same", "bob")[0].kv_key == key_bob and parts.store.contains(key_bob)
    assert per_tenant.delete("/v1/documents/same", headers=BOB).status_code == 200
    assert not parts.store.contains(key_bob) and parts.store.contains(key_alice)


def test_shared_documents_are_every_tenants(make_app, corpus):
    with TestClient(make_app(server={"api_keys": KEYS})) as client:  # retrieval.documents: shared (the default)
        upload(client, ALICE, "notice", "Notice", GARDEN)
        try:
            for headers in (ALICE, BOB):
                ids = {d["id"] for d in client.get("/v1/documents", headers=headers).json()["data"]}
                assert ids == {*corpus.docs, "notice"}
                assert client.get("/v1/documents/notice", headers=headers).status_code == 200
            sources = ask(client, BOB, "How many quince trees grow in the Zorvath garden?")["sources"]
            assert "notice" in {s["doc_id"] for s in sources}
        finally:
            assert client.delete("/v1/documents/notice", headers=BOB).status_code == 200
