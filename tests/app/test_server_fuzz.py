"""Schema-driven fuzzing: schemathesis generates requests from the OpenAPI spec, valid and invalid,
for every operation and sends them in-process over ASGI; none may get a 5xx. Bounded: a few
examples per operation, on an app whose limits keep any generation to a token or two over one
passage."""
from __future__ import annotations

from urllib.parse import quote

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

pytestmark = pytest.mark.slow

EXAMPLES = 5  # per operation and mode


@pytest.fixture(scope="module")
def api_schema(make_app, corpus):
    app = make_app(retrieval={"top_k": 1}, limits={"max_top_k": 2, "max_new_tokens": 2, "default_max_new_tokens": 1,
                                                    "max_question_chars": 300, "max_body_bytes": 20_000})
    yield schemathesis.openapi.from_asgi("/openapi.json", app)
    # Leave the shared corpus as it was: drop fuzzed documents, restore any the fuzzer deleted.
    with TestClient(make_app()) as client:
        for doc in client.get("/v1/documents").json()["data"]:
            if doc["id"] not in corpus.docs:
                assert client.delete(f"/v1/documents/{quote(doc['id'], safe='')}").status_code == 200
        for doc_id, (title, text) in corpus.docs.items():
            assert client.post("/v1/documents", json={"id": doc_id, "title": title, "text": text}).status_code == 201


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_no_request_makes_a_server_error(api_schema, mode):
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/query", "/v1/chat/completions", "/v1/documents"}
    for operation in operations:
        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def check(case):
            response = case.call()
            assert response.status_code < 500, \
                f"{case.method} {case.formatted_path} {case.body!r} -> {response.status_code} {response.text[:300]}"
        try:
            check()
        except Unsatisfiable:  # nothing in this operation can be made invalid (e.g. GET /health)
            assert mode is GenerationMode.NEGATIVE
