"""Ingest: bookkeeping (re-ingest, replace, delete, failures) and the real `ragblend ingest` end to end."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

import app.components
from app.cli.commands import run_ingest
from app.cli.main import cli
from app.components import Components
from app.engine.ingest import IngestCancelled, IngestError, Ingestor, SourceDocument, collect_files, read_documents
from blend import PromptFormat, hash_ids
from retrieval import Chunker, ChunkingSettings, Retriever
from store import build_store, kv_key
from tests.helpers import (
    MODEL_CACHE,
    ROOT,
    DictKVCache,
    random_kv,
    shared_embedder,
    shared_llm,
    shared_tokenizer,
    test_settings,
)

LONG = " ".join(f"Sentence {i} of the long document talks about harbour number {i}." for i in range(12))


# Bookkeeping, with a dict standing in for the KV store -------------------------------------------

@pytest.fixture
def parts(tmp_path):
    retriever = Retriever(tmp_path / "index", shared_embedder())
    kv = DictKVCache()
    chunker = Chunker(shared_tokenizer(), ChunkingSettings(target_tokens=40, max_tokens=64, min_tokens=4))
    yield Ingestor(retriever, chunker, kv), retriever, kv
    retriever.close()


def stored_keys(retriever: Retriever) -> set[str]:
    return {c.kv_key for d in retriever.list_documents() for c in retriever.document_chunks(d.id)}


def test_reingest_is_idempotent_and_a_change_replaces(parts):
    ingestor, retriever, kv = parts
    embedded, precomputed = [], []
    ingestor.on_embedded, ingestor.on_precomputed = embedded.append, precomputed.append
    assert ingestor.ingest_text("long", "Long", LONG).status == "added"
    assert sum(embedded) == sum(precomputed) == len(retriever) > 2  # the progress bars' feed
    assert ingestor.ingest_text("short", "Short", "A short note about the tides.").status == "added"
    first = {c.ordinal: c for c in retriever.document_chunks("long")}
    assert len(first) > 2 and set(kv.entries) == stored_keys(retriever)

    kv.fail_on = "harbour"  # any KV work now would raise: unchanged documents must not need any
    assert ingestor.ingest_text("long", "Long", LONG).status == "unchanged"
    ingestor.ingest_text("lines", "Lines", "First line.\nSecond line.")
    assert ingestor.ingest_text("lines", "Lines", "First line.\r\nSecond line.").status == "unchanged"
    kv.fail_on = None

    changed = LONG.replace("Sentence 11 of", "The last sentence of")  # only the last chunk changes
    result = ingestor.ingest_text("long", "Long", changed)
    assert (result.status, result.n_chunks) == ("updated", len(first))
    after = {c.ordinal: c for c in retriever.document_chunks("long")}
    assert after[0].kv_key == first[0].kv_key and after[len(first) - 1].kv_key != first[len(first) - 1].kv_key
    assert set(kv.entries) == stored_keys(retriever)  # the replaced chunk's KV is gone
    assert sorted(retriever.index.ids()) == sorted(retriever.metadata.chunk_ids())

    assert ingestor.ingest_text("long", "A new title", changed).status == "updated"  # titles are in the KV
    assert set(kv.entries) == stored_keys(retriever)


def test_shared_chunks_keep_their_kv_until_the_last_user_goes(parts):
    ingestor, retriever, kv = parts
    ingestor.ingest_text("a", "Same", "Identical text in two documents.")
    ingestor.ingest_text("b", "Same", "Identical text in two documents.")
    assert len(kv.entries) == 1
    ingestor.delete("a")
    assert len(kv.entries) == 1
    ingestor.delete("b")
    assert kv.entries == {} and len(retriever) == 0
    with pytest.raises(KeyError):
        ingestor.delete("b")


@pytest.mark.parametrize("failure", ["kv", "embed"])
def test_a_failure_mid_document_leaves_the_previous_version(parts, failure, monkeypatch):
    ingestor, retriever, kv = parts
    ingestor.ingest_text("long", "Long", LONG)
    before = [(c.id, c.text, c.kv_key) for c in retriever.document_chunks("long")]
    entries = dict(kv.entries)

    new_version = LONG.replace("Sentence 5 of", "BROKEN sentence of").replace("Sentence 0 of", "The first of")
    if failure == "kv":
        kv.fail_on = "BROKEN"  # the first chunk's KV is written, then the second one fails
    else:
        def out_of_memory(*args, **kwargs):
            raise MemoryError

        monkeypatch.setattr(retriever.embedder, "embed", out_of_memory)
    with pytest.raises(RuntimeError if failure == "kv" else MemoryError):
        ingestor.ingest_text("long", "Long", new_version)

    assert [(c.id, c.text, c.kv_key) for c in retriever.document_chunks("long")] == before
    assert kv.entries == entries  # what was written for the failed version is gone again
    assert sorted(retriever.index.ids()) == sorted(retriever.metadata.chunk_ids())


def test_collections_keep_ids_and_kv_keys_apart_and_a_failure_leaves_both(parts):
    """retrieval.documents: tenant: an Ingestor writes one tenant's collection: the same id and text in two
    collections are two documents with two sets of KV keys; a failed ingest in one leaves both as they were."""
    from dataclasses import replace

    ingestor, retriever, kv = parts
    acme, beta = replace(ingestor, collection="acme"), replace(ingestor, collection="beta")
    assert acme.ingest_text("long", "Long", LONG).status == beta.ingest_text("long", "Long", LONG).status == "added"
    keys = {who: [c.kv_key for c in retriever.document_chunks("long", who)] for who in ("acme", "beta")}
    assert keys["acme"] and not set(keys["acme"]) & set(keys["beta"]) and set(kv.entries) == {*keys["acme"],
                                                                                              *keys["beta"]}
    assert retriever.get_document("long") is None and acme.ingest_text("long", "Long", LONG).status == "unchanged"

    kv.fail_on, entries = "BROKEN", dict(kv.entries)
    with pytest.raises(RuntimeError):
        beta.ingest_text("long", "Long", LONG.replace("Sentence 5 of", "BROKEN sentence of"))
    assert {who: [c.kv_key for c in retriever.document_chunks("long", who)] for who in keys} == keys
    assert kv.entries == entries and sorted(retriever.index.ids()) == sorted(retriever.metadata.chunk_ids())
    kv.fail_on = None

    with pytest.raises(KeyError):
        replace(ingestor, collection="other").delete("long")
    beta.delete("long")
    assert set(kv.entries) == set(keys["acme"]) and retriever.get_document("long", "acme") is not None


def test_ingest_for_a_tenant(tmp_path, env):
    """`ragblend ingest --tenant NAME` writes that tenant's collection; refused where it would be lost: documents
    shared, or a tenant server.api_keys does not name (nothing is loaded then)."""
    (tmp_path / "note.txt").write_text("The ferry to Alder Isle leaves at nine.")
    refused = ragblend(env, str(tmp_path / "note.txt"), "--tenant", "acme")
    assert refused.exit_code == 2 and "retrieval.documents is shared" in refused.output
    env = {**env, "RAGBLEND_RETRIEVAL__DOCUMENTS": "tenant", "RAGBLEND_SERVER__API_KEYS": '{"k-1": "acme"}'}
    unknown = ragblend(env, str(tmp_path / "note.txt"), "--tenant", "acme-typo")
    assert unknown.exit_code == 2 and "no such tenant" in unknown.output and "known: acme" in unknown.output
    result = ragblend(env, str(tmp_path / "note.txt"), "--tenant", "acme")
    assert result.exit_code == 0, result.output
    assert "tenant acme: ingest: 1 added" in result.stdout
    parts = Components(test_settings(Path(env["RAGBLEND_DATA_DIR"])))
    try:
        assert parts.retriever.get_document("note", "acme").n_chunks == 1
        assert parts.retriever.get_document("note") is None  # not in the shared collection
    finally:
        parts.close()


def test_empty_documents_and_ids_are_refused(parts):
    ingestor = parts[0]
    with pytest.raises(IngestError, match="empty document"):
        ingestor.ingest_text("x", "T", " \n\t ")
    with pytest.raises(IngestError, match="document id '': must not be empty"):
        ingestor.ingest_text("  ", "T", "text")
    with pytest.raises(IngestError, match="title .*control characters"):
        ingestor.ingest_text("x", "\x1b[31mred", "text")


def test_document_ids_and_titles(tmp_path):
    root = tmp_path / "docs"
    (root / "sub").mkdir(parents=True)
    (root / "a.md").write_text("\n# Title A\n\nBody of A.\n## Section\nmore")
    (root / "sub" / "b.txt").write_text("Body of B.")
    (root / "sub" / "c.md").write_text("No heading first.\n\n# Later heading\n")
    (root / "faq.jsonl").write_text('{"id": 7, "title": "Seven", "text": "x"}\n\n{"text": "y"}\n')
    (root / "skip.pdf").write_text("ignored inside folders")
    (root / ".hidden.md").write_text("ignored")
    files, errors = collect_files([root, root / "sub" / "b.txt"])
    assert errors == []
    assert [(p.name, i) for p, i in files] == [("a.md", "a"), ("faq.jsonl", "faq"), ("b.txt", "sub/b"),
                                               ("c.md", "sub/c"), ("b.txt", "b")]
    docs = [d for path, doc_id in files for d in read_documents(path, doc_id)[0]]
    assert [(d.doc_id, d.title) for d in docs] == [("a", "Title A"), ("7", "Seven"), ("faq:3", "faq"),
                                                   ("sub/b", "b"), ("sub/c", "Later heading"), ("b", "b")]
    assert docs[0].text.strip() == "Body of A.\n## Section\nmore"  # an opening heading becomes the title
    assert docs[4].text.startswith("No heading first.")  # a later one stays in the text
    assert docs[2].source == f"{root / 'faq.jsonl'}:3"


def test_unreadable_file(tmp_path, monkeypatch):
    path = tmp_path / "secret.txt"
    path.write_text("x")
    def denied(self):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "read_bytes", denied)
    assert read_documents(path, "secret") == ([], [f"{path}: cannot read: Permission denied"])



def test_a_batch_commits_all_documents_or_none(parts):
    ingestor, retriever, kv = parts
    ingestor.ingest_text("kept", "Kept", "This document was there before the batch.")
    before, entries = retriever.list_documents(), dict(kv.entries)
    batch = [SourceDocument("first", "First", "The first document of the batch is fine.", "upload"),
             SourceDocument("second", "Second", "The second one holds a BROKEN passage.", "upload")]
    kv.fail_on = "BROKEN"
    with pytest.raises(RuntimeError):
        ingestor.commit_all([ingestor.prepare(d) for d in batch])
    assert retriever.list_documents() == before and retriever.get_document("first") is None
    assert kv.entries == entries  # the first document's KV, written before the failure, is gone again

    kv.fail_on = None
    results = ingestor.commit_all([ingestor.prepare(d) for d in batch])
    assert [(r.doc_id, r.status) for r in results] == [("first", "added"), ("second", "added")]
    assert sorted(d.id for d in retriever.list_documents()) == ["first", "kept", "second"]
    assert sorted(retriever.index.ids()) == sorted(retriever.metadata.chunk_ids())


def test_a_cancelled_ingest_commits_nothing(parts):
    ingestor, retriever, kv = parts
    chunks_done = []
    ingestor.on_precomputed = chunks_done.append
    with pytest.raises(IngestCancelled):
        ingestor.commit(ingestor.prepare(SourceDocument("long", "Long", LONG, "upload")),
                        cancelled=lambda: len(chunks_done) >= 1)
    assert len(chunks_done) == 1 and retriever.get_document("long") is None and kv.entries == {}

# The real command: SmolLM2 KV precompute into the tiered store, MiniLM, FAISS, SQLite ------------

@pytest.fixture
def env(tmp_path, monkeypatch):
    """Environment for `ragblend` in a fresh data dir; models are loaded once per session."""
    monkeypatch.setattr(app.components, "load_model", lambda *args, **kwargs: shared_llm())
    monkeypatch.setattr(app.components, "open_embedder", lambda settings: shared_embedder())
    return {"RAGBLEND_DATA_DIR": str(tmp_path / "data"), "RAGBLEND_MODEL__CACHE_DIR": str(MODEL_CACHE)}


def ragblend(env: dict[str, str], *args: str):
    return CliRunner().invoke(cli, ["ingest", *args], env=env)


def inspect(env: dict[str, str]) -> tuple[dict[str, list[str]], set[str]]:
    """(doc id -> its chunks' kv keys, the chunk kv keys in the on-disk store), read back from disk."""
    settings = test_settings(Path(env["RAGBLEND_DATA_DIR"]))
    parts = Components(settings)
    retriever = parts.retriever
    docs = {d.id: [c.kv_key for c in retriever.document_chunks(d.id)] for d in retriever.list_documents()}
    assert sorted(retriever.index.ids()) == sorted(retriever.metadata.chunk_ids())
    parts.close()
    with build_store(settings.store, settings.kv_dir, shared_llm().fingerprint) as store:
        [disk] = [t for t in store.tiers if t.name == "disk"]  # this process's memory tier is empty
        held = set(disk.keys())
    head_ids = PromptFormat(shared_tokenizer(), settings.model.system_prompt).head_ids
    held.discard(kv_key(shared_llm().fingerprint, hash_ids([]), head_ids))  # the prompt head's own KV
    return docs, held


def test_ingest_demo_corpus_then_reingest_change_and_delete(tmp_path, env):
    corpus = tmp_path / "corpus"
    shutil.copytree(ROOT / "corpus", corpus)
    result = ragblend(env, str(corpus))
    assert result.exit_code == 0, result.output
    assert "11 added, 0 updated, 0 unchanged, 0 deleted, 0 failed" in result.stdout
    docs, held = inspect(env)
    assert sorted(docs) == ["alderwick/history", "alderwick/lantern-festival", "alderwick/lighthouse",
                            "alderwick/town", "bluefin-faq/about", "bluefin-faq/hours", "bluefin-faq/returns",
                            "bluefin-faq/shipping", "howto/bicycle-gears", "howto/harbour-oat-bread",
                            "howto/tides"]
    assert held == {k for keys in docs.values() for k in keys}  # every chunk's KV is precomputed

    settings = test_settings(Path(env["RAGBLEND_DATA_DIR"]))
    retriever = Components(settings).retriever
    assert retriever.search("How tall is Gull Point Lighthouse?", top_k=1)[0].chunk.doc_id == "alderwick/lighthouse"
    assert retriever.search("How long is the Bluefin warranty on engine parts?", top_k=1)[0].chunk.doc_id == \
        "bluefin-faq/returns"
    retriever.close()

    result = ragblend(env, str(corpus))
    assert result.exit_code == 0 and "0 added, 0 updated, 11 unchanged" in result.stdout, result.output

    faq = corpus / "bluefin-faq.jsonl"  # one of its four documents changes
    faq.write_text(faq.read_text().replace("Standard delivery takes 2 to 3", "Standard delivery takes 3 to 4"))
    result = ragblend(env, str(corpus))
    assert result.exit_code == 0 and "0 added, 1 updated, 10 unchanged" in result.stdout, result.output
    new_docs, held = inspect(env)
    assert new_docs["bluefin-faq/shipping"] != docs["bluefin-faq/shipping"]
    assert {d: k for d, k in new_docs.items() if d != "bluefin-faq/shipping"} == \
        {d: k for d, k in docs.items() if d != "bluefin-faq/shipping"}
    assert held == {k for keys in new_docs.values() for k in keys}  # the old version's KV is gone

    result = ragblend(env, "--delete", "alderwick/lighthouse", "--delete", "no-such-doc")
    assert result.exit_code == 1
    assert "error: --delete no-such-doc: unknown document id" in result.stderr
    assert "1 deleted, 1 failed" in result.stdout
    final_docs, held = inspect(env)
    assert "alderwick/lighthouse" not in final_docs and len(final_docs) == 10
    assert held == {k for keys in final_docs.values() for k in keys}


def test_store_gc_removes_the_kv_no_document_prompt_head_or_lease_owns(tmp_path, env):
    """Issue #41: entries nobody owns (an upload killed before its commit, a conversation's KV) are removed by
    `ragblend store gc` once unused for --min-idle-s; documents', the prompt head's and leased ones stay."""
    (tmp_path / "note.md").write_text("# Ferry\n\nThe ferry to Alderwick leaves at nine and at four.")
    assert ragblend(env, str(tmp_path / "note.md")).exit_code == 0
    docs, _ = inspect(env)
    parts = Components(test_settings(Path(env["RAGBLEND_DATA_DIR"])))
    (orphan, orphan_kv), (leased, leased_kv) = (random_kv(i, fingerprint=shared_llm().fingerprint) for i in (1, 2))
    parts.store.put(orphan, orphan_kv)
    parts.store.put(leased, leased_kv)
    assert parts.store.lease([leased], "a client's context", ttl_s=3600).complete
    parts.close()

    def gc(*args: str) -> dict:
        result = CliRunner().invoke(cli, ["store", "gc", *args], env=env)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)["disk"]

    assert gc()["orphans"]["kept_recent"] == 1  # used just now: kept by the default --min-idle-s
    report = gc("--min-idle-s", "0")["orphans"]
    assert report["removed"] == 1 and report["removed_bytes"] > 0 and report["kept_leased"] == 1
    assert report["kept_owned"] == len(docs["note"]) + 1  # the chunks and the prompt head
    _, held = inspect(env)  # chunks' KV only, the head left out
    assert held == set(docs["note"]) | {leased}


def test_bad_inputs_are_reported_and_the_rest_is_ingested(tmp_path, env):
    d = tmp_path / "in"
    d.mkdir()
    (d / "good.md").write_text("# Good\n\nThe ferry leaves at nine.")
    (d / "binary.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    (d / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (d / "empty.md").write_text("# Only a title\n\n")
    (d / "lines.jsonl").write_text('{"id": "ok", "text": "Line one is fine."}\n{"id": "broken", "text": \n'
                                   '{"title": "no text"}\n["not", "an", "object"]\n')
    (d / "notes.pdf").write_text("pdf")

    args = [d / "good.md", d / "missing.txt", d / "binary.txt", d / "latin1.txt", d / "empty.md",
            d / "lines.jsonl", d / "notes.pdf"]
    result = ragblend(env, *map(str, args))
    assert result.exit_code == 1, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    expected = [f"{d / 'missing.txt'}: no such file or folder",
                f"{d / 'notes.pdf'}: unsupported file type '.pdf'",
                f"{d / 'binary.txt'}: binary file",
                f"{d / 'latin1.txt'}: not UTF-8 text",
                f"{d / 'lines.jsonl'}:2: malformed JSON",
                f"{d / 'lines.jsonl'}:3: expected an object with a \"text\" string",
                f"{d / 'lines.jsonl'}:4: expected an object",
                f"{d / 'empty.md'}: empty document"]
    for message in expected:
        assert sum(message in line for line in errors) == 1, (message, errors)
    assert len(errors) == len(expected)
    assert "2 added, 0 updated, 0 unchanged, 0 deleted, 8 failed" in result.stdout
    docs, _ = inspect(env)
    assert sorted(docs) == ["good", "ok"]


def test_a_document_over_the_size_limit_is_one_error_line(tmp_path, env):
    (tmp_path / "big.txt").write_text("a" * 101)
    (tmp_path / "small.txt").write_text("A short note about the harbour.")
    result = ragblend({**env, "RAGBLEND_LIMITS__MAX_DOCUMENT_CHARS": "100"}, str(tmp_path / "big.txt"),
                      str(tmp_path / "small.txt"))
    assert result.exit_code == 1 and "1 added" in result.stdout and "1 failed" in result.stdout
    [line] = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert "big.txt: 101 characters, over the limit of 100" in line


def test_all_inputs_bad_fails_fast_and_usage_errors_exit_2(tmp_path, env, monkeypatch):
    monkeypatch.setattr(app.components, "load_model", lambda *args, **kwargs: pytest.fail("no model should load"))
    result = ragblend(env, str(tmp_path / "nothing-here"))
    assert result.exit_code == 1 and f"error: {tmp_path / 'nothing-here'}: no such file or folder" in result.stderr
    assert ragblend(env).exit_code == 2  # neither PATH nor --delete


def test_a_deeply_nested_jsonl_line_is_one_error_line(tmp_path, env, monkeypatch):
    """100,000 brackets raise RecursionError in json.loads: an error line and exit code 1, never a traceback."""
    monkeypatch.setattr(app.components, "load_model", lambda *args, **kwargs: pytest.fail("no model should load"))
    deep = tmp_path / "deep.jsonl"
    deep.write_bytes(b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n")
    result = ragblend(env, str(deep))
    assert result.exit_code == 1 and not isinstance(result.exception, RecursionError), result.exception
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == \
        [f"error: {deep}:1: nested too deeply"]


def test_a_crash_mid_batch_keeps_what_was_committed(tmp_path, monkeypatch):
    from app.engine.kv import ChunkKVCache

    monkeypatch.setattr(app.components, "load_model", lambda *args, **kwargs: shared_llm())
    monkeypatch.setattr(app.components, "open_embedder", lambda settings: shared_embedder())
    (tmp_path / "a.txt").write_text("Ferries to the island leave at nine every morning.")
    (tmp_path / "b.txt").write_text("The island has one shop.\n\nIt opens at ten and closes at four.")
    real_ensure = ChunkKVCache.ensure

    def ensure(self, ids, collection=""):
        if "four" in shared_tokenizer().decode(ids):  # the last of b's three chunks
            raise RuntimeError("killed mid-precompute")
        return real_ensure(self, ids, collection)

    monkeypatch.setattr(ChunkKVCache, "ensure", ensure)
    settings = test_settings(tmp_path / "data", chunking={"target_tokens": 8, "max_tokens": 16, "min_tokens": 2})
    assert run_ingest(settings, [tmp_path / "a.txt", tmp_path / "b.txt"], []) == 1
    env = {"RAGBLEND_DATA_DIR": str(tmp_path / "data")}
    docs, held = inspect(env)
    assert list(docs) == ["a"] and held == set(docs["a"])  # the KV of b's first two chunks was removed again


def test_ingest_text_for_the_api(tmp_path, monkeypatch):
    from app.cli.commands import open_ingestor

    monkeypatch.setattr(app.components, "load_model", lambda *args, **kwargs: shared_llm())
    monkeypatch.setattr(app.components, "open_embedder", lambda settings: shared_embedder())
    with open_ingestor(test_settings(tmp_path)) as ingestor:
        result = ingestor.ingest_text("upload-1", "Upload", "The museum opens in April.", source="upload")
        assert (result.doc_id, result.status, result.n_chunks) == ("upload-1", "added", 1)
        [hit] = ingestor.retriever.search("When does the museum open?", top_k=1)
        kv_cache = ingestor.kv_cache
        assert hit.chunk.kv_key == kv_cache.key(kv_cache.passage_ids(hit.chunk.token_ids, "Upload"))
        assert kv_cache.store.contains(hit.chunk.kv_key)
        ingestor.delete("upload-1")
        assert not kv_cache.store.contains(hit.chunk.kv_key)
        with pytest.raises(KeyError):
            ingestor.delete("upload-1")
    assert SourceDocument("x", None, "t", "s").title is None
