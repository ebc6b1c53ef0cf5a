"""The API contract, fuzzed: schemathesis generates requests from the OpenAPI description - its examples,
its coverage cases (boundaries, every enum, missing and wrong types, methods the spec does not list) and
random valid and invalid data - and sends them in-process over ASGI. Every check runs on every answer:
no 5xx, the status codes, content types, headers and bodies the description promises, valid data
accepted and invalid data refused. Bounded and repeatable: a fixed seed, a few examples per operation,
on an app whose limits keep any generation to a token or two over one passage."""
from __future__ import annotations

import json
from urllib.parse import quote

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import strategies as st
from schemathesis.config import SchemathesisConfig
from schemathesis.engine import Status, events

pytestmark = pytest.mark.slow

# What an uploaded file holds, by its part's content type: what the description states in words (UTF-8 text
# that is not blank, no NUL; a .jsonl file one {"text"} object a line), which JSON Schema cannot say of bytes.
TEXT = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00#\ufeff"), min_size=1,
               max_size=200).filter(str.strip)
schemathesis.openapi.media_type("text/plain", TEXT.map(str.encode), aliases=["text/markdown"])
schemathesis.openapi.media_type(
    "application/jsonl", st.lists(TEXT.map(lambda text: json.dumps({"text": text})), min_size=1, max_size=3)
    .map(lambda lines: "\n".join(lines).encode()), aliases=["application/x-ndjson"])

MAX_BODY_BYTES = 20_000
CONFIG = SchemathesisConfig.from_dict({
    "seed": 41,
    "generation": {"mode": "all", "max-examples": 3, "database": "none", "deterministic": True},
    "phases": {
        "stateful": {"enabled": False},  # the operations share one corpus: no chains of calls
        # Error feedback turns a 4xx's message into new "valid" cases outside the description, such as PNG
        # bytes sent as a text/plain file: UTF-8 is a rule JSON Schema cannot state of bytes (it is stated
        # in words, and the strategies above follow it).
        "fuzzing": {"error-feedback": {"enabled": False}}},
    "request-timeout": 300,  # an upload's KV precompute on a loaded machine: speed is bench/'s business
})


@pytest.fixture(scope="module")
def api_schema(make_app, corpus):
    app = make_app(retrieval={"top_k": 1}, limits={"max_top_k": 2, "max_new_tokens": 2, "default_max_new_tokens": 1,
                                                    "max_question_chars": 300, "max_body_bytes": MAX_BODY_BYTES})
    yield schemathesis.openapi.from_asgi("/openapi.json", app, config=CONFIG)
    # Leave the shared corpus as it was: drop fuzzed documents, restore any the fuzzer deleted or replaced.
    with TestClient(make_app()) as client:
        for doc in client.get("/v1/documents").json()["data"]:
            if doc["id"] not in corpus.docs:
                assert client.delete(f"/v1/documents/{quote(doc['id'], safe='')}").status_code == 200
        for doc_id, (title, text) in corpus.docs.items():
            restored = client.post("/v1/documents", params={"replace": "true"},
                                   json={"id": doc_id, "title": title, "text": text})
            assert restored.status_code == 201, restored.text


def test_the_api_keeps_its_contract(api_schema):
    """The schemathesis engine, as its CLI runs it with `--checks all`: any failed check or error fails."""
    problems, requests = [], 0
    for event in schemathesis.engine.from_schema(api_schema).execute():
        if isinstance(event, events.ScenarioFinished):
            requests += len(event.recorder.interactions)
            problems += [_describe(event.recorder, case_id, check) for case_id, checks in event.recorder.checks.items()
                         for check in checks if check.status == Status.FAILURE
                         and not _a_file_that_is_not_text(event.recorder, case_id, check)
                         and not _a_rule_json_schema_cannot_state(event.recorder, case_id, check)]
        elif isinstance(event, (events.NonFatalError, events.FatalError)):
            problems.append(f"{getattr(event, 'label', 'engine')}: {event.info.format()}")
    print(f"schemathesis: {requests} requests")
    assert requests > 300  # every phase ran (examples, coverage, fuzzing) on every operation
    assert not problems, "\n\n".join(problems[:10]) + f"\n\n({len(problems)} problems)"


def _a_file_that_is_not_text(recorder, case_id: str, check) -> bool:
    """An upload refused because its file is not UTF-8 text: the one rule JSON Schema cannot state (of a
    binary part), stated in words in the request body's description and its file's; the fuzzer sends random bytes
    as a text/plain file now and then."""
    interaction = recorder.interactions.get(case_id)
    if check.name != "positive_data_acceptance" or interaction is None or interaction.response is None:
        return False
    error = json.loads(interaction.response.content or b"{}").get("error", {})
    return (interaction.response.status_code, error.get("param")) == (422, "file") and \
        any(reason in error.get("message", "") for reason in ("not UTF-8 text", "binary file, not text"))


def _a_rule_json_schema_cannot_state(recorder, case_id: str, check) -> bool:
    """Valid data refused by a rule no JSON Schema keyword can state, stated in words in the description:
    - a tool_choice naming a tool not among `tools` (a reference from one field's value to another's items; a
      forced call without tools is stated, with if/then);
    - a schema (response_format, a tool's parameters or input_schema) the grammar engine cannot take: past its
      size in characters or its depth (of free-form JSON), more string patterns intersected than it compiles in
      time, one past the compile time limit, one no finite document satisfies ($ref cycles: satisfiability is no
      keyword), or one that does not compile; and an assistant's prefill that such a grammar refuses as the
      answer's start (text against a grammar);
    - the word pieces the embedder reads (/v1/embeddings: a tokenizer's count, not characters);
    - a body over limits.max_body_bytes, valid or not (its size in bytes, checked before the body is read;
      /v1/messages takes free-form tool inputs and schemas, so the fuzzer's bodies can be any size).
    (An upload's file that is not UTF-8 text: `_a_file_that_is_not_text`.)"""
    interaction = recorder.interactions.get(case_id)
    if interaction is None or interaction.response is None:
        return False
    status, body = interaction.response.status_code, json.loads(interaction.response.content or b"{}")
    if status == 413 and len(interaction.request.body or b"") > MAX_BODY_BYTES:  # refused, valid or not
        return check.name in ("positive_data_acceptance", "negative_data_rejection")
    if check.name != "positive_data_acceptance":
        return False
    message = body.get("error", {}).get("message", "")
    in_words = ("is not among the tools (",  # tool_choice's tool must be one of `tools`
                # a schema the grammar engine cannot take (see above)
                "a schema of", "a schema nested deeper than", "the schema is too complex", "allows no finite document",
                "allows no document", "the schema does not compile", "the assistant's prefill",
                "word pieces, over the")  # the word pieces the embedder reads (/v1/embeddings)
    # top_logprobs without logprobs, a forced call without tools, a tool name holding the call markup, a content
    # part not text, a token id past the vocabulary and `dimensions` not the embedder's are stated as JSON Schema
    # (test_ids_and_contract.py), as are any number of cache_control breakpoints and an assistant's message last (a
    # prefill, taken): none is excused here
    return status == 400 and any(rule in message for rule in in_words)


def _describe(recorder, case_id: str, check) -> str:
    failure = check.failure_info.failure
    interaction = recorder.interactions.get(case_id)
    request = f"{interaction.request.method} {interaction.request.uri} {(interaction.request.body or b'')[:200]!r}" \
        if interaction else case_id
    response = f"-> {interaction.response.status_code} {interaction.response.content[:300]!r}" \
        if interaction and interaction.response else ""
    meta = recorder.cases[case_id].value.meta if case_id in recorder.cases else None
    how = f" [{meta.phase.name.value} phase, {meta.generation.mode.value} data]" if meta else ""
    return f"{recorder.label}: {check.name}{how}: {failure.title}: {failure.message[:300]}\n  {request} {response}"
