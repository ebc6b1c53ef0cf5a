"""The cache endpoint: GET /v1/cache (tiers, pinned bytes, hit rates, leases by family), DELETE
/v1/cache?prompt_cache_key=... (a family's leases and entries), behind the API key; leases in /metrics."""
from __future__ import annotations

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from store import family_id
from tests.helpers import random_kv

AUTH = {"Authorization": "Bearer k"}


def samples(text: str) -> dict[tuple[str, tuple[str, ...]], float]:
    """(name, label values) -> value of every sample in a /metrics page."""
    return {(s.name, tuple(s.labels.values())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_the_cache_endpoint_reports_leases_and_drops_a_family(corpus, engine_with):
    from app.api.server import create_app

    settings, engine = engine_with(server={"api_key": "k"})
    parts, question = engine.parts, corpus.questions[0][0]
    with TestClient(create_app(settings, engine)) as client:
        assert client.get("/v1/cache").status_code == 401
        assert client.delete("/v1/cache", params={"prompt_cache_key": "x"}).status_code == 401
        assert client.post("/v1/query", json={"question": question, "top_k": 1, "max_tokens": 1},
                           headers=AUTH).status_code == 200
        [hit] = parts.retriever.search(question, 1)
        passage = parts.kv_cache.key(parts.kv_cache.passage_ids(hit.chunk.token_ids, hit.title))
        message, message_kv = random_kv(7, fingerprint=parts.llm.fingerprint)  # a conversation's own KV
        parts.store.put(message, message_kv)
        leased = parts.store.lease([passage, message], "my-app: user 42", ttl_s=300)
        assert leased.complete and leased.tiers == ("memory", "disk")

        report = client.get("/v1/cache", headers=AUTH).json()
        assert (report["leases"], report["families"], report["leased_entries"]) == (2, 1, 2)
        memory = report["tiers"]["memory"]
        assert memory["pinned_bytes"] == leased.pinned_bytes["memory"] > 0 and memory["pinned_cap"] > 0
        disk = report["tiers"]["disk"]  # this fresh process found the passage on disk
        assert disk["hits"] >= 1 and 0 < disk["hit_rate"] <= 1 and 0 < report["hit_rate"] <= 1
        assert report["data"] == [{"family": family_id("my-app: user 42"), "entries": 2, "soft": True,
                                   "pinned_bytes": leased.pinned_bytes, "expires_at": leased.expires_at}]
        assert client.get("/v1/cache", params={"prompt_cache_key": "someone else"}, headers=AUTH).json()["data"] == []
        assert "user 42" not in client.get("/v1/cache", headers=AUTH).text  # a family is shown by its hash only
        metrics = samples(client.get("/metrics", headers=AUTH).text)
        assert metrics["ragblend:kv_leases", ()] == 2
        assert metrics["ragblend:kv_pinned_bytes", ("memory",)] == memory["pinned_bytes"]
        assert metrics["ragblend:kv_lease_refusals_total", ("disk",)] == 0
        assert ("ragblend:kv_lease_held_evictions_total", ("disk",)) in metrics

        dropped = client.delete("/v1/cache", params={"prompt_cache_key": "my-app: user 42"}, headers=AUTH)
        assert dropped.json() == {"object": "cache.family.deleted", "family": family_id("my-app: user 42"),
                                  "leases_ended": 2, "entries_deleted": 1}
        assert parts.store.contains(passage) and not parts.store.contains(message)  # the document's passage stays
        assert client.get("/v1/cache", headers=AUTH).json()["leases"] == 0
        assert client.delete("/v1/cache", params={"prompt_cache_key": "my-app: user 42"},
                             headers=AUTH).json()["leases_ended"] == 0
        for params in ({}, {"prompt_cache_key": ""}, {"prompt_cache_key": "x" * 1025}):
            assert client.delete("/v1/cache", params=params, headers=AUTH).status_code == 422
    parts.close()
