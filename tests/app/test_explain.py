"""`explain: true` on /v1/query, on the real embedded model: every prompt token with its piece, its
selection score and whether it was recomputed, consistent with the response's stats."""
from __future__ import annotations

import json
from itertools import pairwise

import pytest
from fastapi.testclient import TestClient

pytestmark = pytest.mark.slow

QUESTION = "Who built the lighthouse of Port Velmar?"


def query(client: TestClient, **body) -> dict:
    response = client.post("/v1/query", json={"question": QUESTION, "max_tokens": 2, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_explain_is_absent_unless_asked(client):
    assert query(client)["explain"] is None


def test_blend_explain_matches_the_stats(client):
    result = query(client, recompute_ratio=0.3, top_k=2, explain=True)
    x, stats = result["explain"], result["stats"]
    tokens = x["tokens"]
    assert not x["truncated"] and len(tokens) == x["prompt_tokens"] == stats["prompt_tokens"]
    # the explain counts the positions laid out from the store; the stats' cached_tokens those not recomputed
    assert x["cached_tokens"] == stats["cached_tokens"] + stats["recomputed_tokens"] and x["exact_tokens"] > 0
    selected = [i for i, t in enumerate(tokens) if t["selected"]]
    assert len(selected) == x["selected_tokens"] == stats["recomputed_tokens"] > 0

    # The pieces tile the prompt in order: head, one passage per source, the question.
    chunks = x["chunks"]
    assert [c["kind"] for c in chunks] == ["head", "passage", "passage", "question"]
    assert [c["source"] for c in chunks] == [None, 0, 1, None]
    assert chunks[0]["start"] == 0 and chunks[-1]["end"] == len(tokens)
    assert all(a["end"] == b["start"] for a, b in pairwise(chunks))
    for index, chunk in enumerate(chunks):
        assert {t["chunk"] for t in tokens[chunk["start"]:chunk["end"]]} == {index}
        assert chunk["recomputed"] == sum(t["selected"] for t in tokens[chunk["start"]:chunk["end"]])
    passage = "".join(t["text"] for t in tokens[chunks[1]["start"]:chunks[1]["end"]])
    assert result["sources"][0]["text"] in passage
    assert QUESTION in "".join(t["text"] for t in tokens[chunks[-1]["start"]:])

    # Scores: none on the exact prefix or the question; every other cached token scored, the
    # recomputed ones the highest.
    exact, cached = x["exact_tokens"], x["cached_tokens"]
    assert all(t["score"] is None and not t["selected"] for t in tokens[:exact] + tokens[cached:])
    scored = tokens[exact:cached]
    assert all(t["score"] is not None and t["score"] >= 0 for t in scored)
    assert min(t["score"] for t in scored if t["selected"]) >= max(t["score"] for t in scored if not t["selected"])


def test_the_score_legend_names_the_policy_that_ran(client):
    for selection in ("hkvd", "query"):
        x = query(client, recompute_ratio=0.3, top_k=2, explain=True, selection=selection)["explain"]
        assert x["score"].startswith(f"{selection}: "), x["score"]
    assert "layer 1" in query(client, recompute_ratio=0.3, explain=True, selection="hkvd")["explain"]["score"]


def test_full_and_reuse_recompute_nothing_and_score_nothing(client):
    for mode in ("full", "reuse"):
        x = query(client, mode=mode, explain=True)["explain"]
        assert x["selected_tokens"] == 0 and not any(t["selected"] for t in x["tokens"]), mode
        assert all(t["score"] is None for t in x["tokens"]), mode
    assert query(client, mode="full", explain=True)["explain"]["cached_tokens"] == 0


def test_explain_is_capped_and_says_so(make_app, corpus):
    with TestClient(make_app(limits={"max_explain_tokens": 20})) as client:
        result = query(client, recompute_ratio=0.5, explain=True)
    x = result["explain"]
    assert x["truncated"] and x["max_tokens"] == 20 and len(x["tokens"]) == 20
    assert x["prompt_tokens"] == result["stats"]["prompt_tokens"] > 20
    assert x["selected_tokens"] == result["stats"]["recomputed_tokens"]  # counted over the whole prompt


def test_streamed_result_carries_the_explain(client):
    with client.stream("POST", "/v1/query", json={"question": QUESTION, "max_tokens": 2, "stream": True,
                                                  "explain": True}) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data:")]
    result = json.loads(lines[-1][5:])
    assert len(result["explain"]["tokens"]) == result["stats"]["prompt_tokens"]


def test_explain_is_in_the_openapi_schema(client):
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    assert schemas["QueryRequest"]["properties"]["explain"]["type"] == "boolean"
    assert "Explain" in json.dumps(schemas["QueryResponse"]["properties"]["explain"])
    assert set(schemas["ExplainToken"]["properties"]) == {"text", "chunk", "score", "selected"}
    assert {"tokens", "chunks", "truncated", "exact_tokens", "selected_tokens"} <= set(schemas["Explain"]["properties"])
