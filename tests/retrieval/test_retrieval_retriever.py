"""Retriever: search, document order, updates, recovery of the FAISS file from the metadata, and
replicas following each other through one database (SQLite and PostgreSQL alike)."""
from __future__ import annotations

import sqlite3

import numpy as np
import pytest

from retrieval import Chunker, IndexMismatchError, Retriever, VectorIndex, open_metadata
from retrieval.retriever import DB_FILE, INDEX_FILE

DOCS = {
    "lighthouse": ("Gull Point Lighthouse", "The lighthouse was built in 1891 and is 31 metres tall.\n\n"
                   "Its lamp flashes white every 10 seconds and is seen from 22 nautical miles."),
    "bread": ("Harbour oat bread", "Mix flour, oats, yeast and salt. Knead for 10 minutes.\n\n"
              "Bake the loaf at 200 degrees Celsius for 35 minutes."),
    "gears": ("Bicycle gears", "The gear ratio is chainring teeth divided by cog teeth.\n\n"
              "A derailleur pushes the chain from one cog to the next."),
}


@pytest.fixture
def chunker(tokenizer):
    from retrieval import ChunkingSettings

    return Chunker(tokenizer, ChunkingSettings(target_tokens=24, max_tokens=32, min_tokens=4))  # a chunk a paragraph


def add(retriever: Retriever, chunker: Chunker, doc_id: str, title: str, text: str, keys=None) -> list[str]:
    chunks = chunker.chunk(doc_id, text)
    for chunk, key in zip(chunks, keys or [f"{doc_id}-{c.ordinal}" for c in chunks]):
        chunk.kv_key = key
    return retriever.add_document(doc_id, chunks, title=title, source=f"{doc_id}.md")


@pytest.fixture
def open_retriever(database_url, embedder):
    """open(index_dir, kind="flat") -> a Retriever on the test's database (a process or replica with
    its own FAISS file in `index_dir`); all closed at the end."""
    opened = []

    def open_(index_dir, kind="flat", embedder=embedder):
        metadata = open_metadata(database_url, index_dir)
        opened.append(metadata)
        return Retriever(index_dir, embedder, kind=kind, metadata=metadata)
    yield open_
    for metadata in opened:
        metadata.close()


@pytest.fixture
def retriever(tmp_path, open_retriever, chunker):
    r = open_retriever(tmp_path)
    for doc_id, (title, text) in DOCS.items():
        add(r, chunker, doc_id, title, text)
    return r


def test_search_finds_the_answering_chunk(retriever):
    hits = retriever.search("In which year was the lighthouse built, and how tall is it?", top_k=3)
    assert [h.chunk.doc_id for h in hits[:2]] == ["lighthouse", "lighthouse"]
    [answer] = [h for h in hits if "31 metres" in h.chunk.text]
    assert (answer.chunk.ordinal, answer.title, answer.chunk.kv_key) == (0, "Gull Point Lighthouse", "lighthouse-0")
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    assert retriever.search("At what temperature do I bake the bread?", top_k=1)[0].chunk.doc_id == "bread"
    assert len(retriever.search("anything", top_k=100)) == len(retriever) == 6


def test_document_order_groups_a_document_in_reading_order(retriever):
    question = "How often does the lighthouse lamp flash, and when was it built?"
    by_score = retriever.search(question, top_k=4)
    by_doc = retriever.search(question, top_k=4, order="document")
    assert sorted(h.chunk.id for h in by_doc) == sorted(h.chunk.id for h in by_score)
    docs = [h.chunk.doc_id for h in by_doc]
    assert docs[0] == by_score[0].chunk.doc_id
    assert docs == sorted(docs, key=docs.index)  # each document's chunks are contiguous
    for doc in set(docs):
        ordinals = [h.chunk.ordinal for h in by_doc if h.chunk.doc_id == doc]
        assert ordinals == sorted(ordinals)


def test_replace_and_delete_keep_metadata_and_index_in_step(tmp_path, retriever, chunker, open_retriever):
    old_ids = [c.id for c in retriever.document_chunks("bread")]
    # Chunk 0's key is shared with the new version: only chunk 1's key becomes unreferenced.
    stale = add(retriever, chunker, "bread", "Harbour oat bread", "Bake rye bread at 220 degrees for 50 minutes.",
                keys=["bread-0"])
    assert stale == ["bread-1"] and retriever.is_referenced("bread-0")
    new = retriever.document_chunks("bread")
    assert len(new) == 1 and not set(old_ids) & {c.id for c in new}  # ids are never reused
    assert retriever.search("rye bread temperature", top_k=1)[0].chunk.id == new[0].id

    assert sorted(retriever.delete_document("gears")) == ["gears-0", "gears-1"]
    with pytest.raises(KeyError):
        retriever.delete_document("gears")
    assert [d.id for d in retriever.list_documents()] == ["bread", "lighthouse"]
    assert retriever.get_document("gears") is None and retriever.get_document("bread").n_chunks == 1
    assert sorted(retriever.index.ids()) == sorted(retriever.metadata.chunk_ids())

    reopened = open_retriever(tmp_path)
    assert sorted(reopened.index.ids()) == sorted(retriever.metadata.chunk_ids())
    assert reopened.document_chunks("lighthouse")[0].token_ids == retriever.document_chunks("lighthouse")[0].token_ids


def test_crash_between_metadata_commit_and_index_write_is_repaired(tmp_path, retriever, chunker, monkeypatch,
                                                                   open_retriever):
    def killed(self, path):
        raise KeyboardInterrupt  # the process dies after the commit, before the new file is in place

    monkeypatch.setattr(VectorIndex, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        add(retriever, chunker, "tides", "Tides", "Spring tides come at new and full moon.")
    with pytest.raises(KeyboardInterrupt):
        retriever.delete_document("gears")
    monkeypatch.undo()

    # The live retriever caught up in memory; the file still holds the old ids.
    assert retriever.search("When are spring tides?", top_k=1)[0].chunk.doc_id == "tides"
    reopened = open_retriever(tmp_path)  # lines the file up with the table: only the difference is fetched
    assert sorted(d.id for d in reopened.list_documents()) == ["bread", "lighthouse", "tides"]
    assert sorted(reopened.index.ids()) == sorted(reopened.metadata.chunk_ids())
    assert reopened.search("When are spring tides?", top_k=1)[0].chunk.doc_id == "tides"
    assert sorted(VectorIndex.load(tmp_path / INDEX_FILE).ids()) == sorted(reopened.metadata.chunk_ids())


def test_torn_index_file_is_rebuilt(tmp_path, retriever, open_retriever):
    (tmp_path / INDEX_FILE).write_bytes(b"\x00" * 100)
    reopened = open_retriever(tmp_path)
    assert len(reopened) == 6 and reopened.search("derailleur", top_k=1)[0].chunk.doc_id == "gears"


def test_another_replica_commit_is_caught_up_before_the_next_search(tmp_path, retriever, chunker, open_retriever,
                                                                    monkeypatch):
    # Another replica with its own FAISS file (or `ragblend ingest` next to the server).
    writer = open_retriever(tmp_path / "other")
    assert len(writer) == len(retriever) == 6
    index = retriever.index
    add(writer, chunker, "tides", "Tides", "Spring tides come at new and full moon.")
    writer.delete_document("gears")

    def no_rebuild(*args):
        raise AssertionError("catching up must not rebuild the index")
    monkeypatch.setattr(Retriever, "_synced", no_rebuild)
    monkeypatch.setattr(VectorIndex, "build", no_rebuild)
    assert retriever.search("When are spring tides?", top_k=1)[0].chunk.doc_id == "tides"
    assert "gears" not in {h.chunk.doc_id for h in retriever.search("derailleur chain cog", top_k=6)}
    assert retriever.index is index and sorted(index.ids()) == sorted(writer.index.ids())
    assert not retriever.refresh()  # nothing changed since: one cheap check, no work


def test_a_chunk_deleted_between_catch_up_and_lookup_is_left_out(retriever, monkeypatch):
    monkeypatch.setattr(Retriever, "refresh", lambda self: False)  # the deletion lands after the catch-up
    retriever.metadata.delete_document("gears")
    hits = retriever.search("derailleur chain cog", top_k=6)
    assert len(hits) == 4 and "gears" not in {h.chunk.doc_id for h in hits}


def test_hnsw_index_rebuilds_on_delete(tmp_path, chunker, open_retriever):
    r = open_retriever(tmp_path, kind="hnsw")
    for doc_id, (title, text) in DOCS.items():
        add(r, chunker, doc_id, title, text)
    other = open_retriever(tmp_path / "other", kind="hnsw")
    r.delete_document("lighthouse")
    assert len(r) == 4 and r.index.kind == "hnsw"
    assert r.search("How tall is the lighthouse?", top_k=4)[0].chunk.doc_id != "lighthouse"
    assert other.search("How tall is the lighthouse?", top_k=4)[0].chunk.doc_id != "lighthouse" and len(other) == 4
    flat = open_retriever(tmp_path, kind="flat")  # switching kinds rebuilds from the metadata
    assert flat.index.kind == "flat" and len(flat) == 4


def test_another_embedder_is_refused(tmp_path, retriever, open_retriever):
    class Other:
        name, dim = "other-model", retriever.embedder.dim

    with pytest.raises(IndexMismatchError, match="other-model"):
        open_retriever(tmp_path / "other", embedder=Other())


def test_metadata_stores_no_pickle(tmp_path, embedder, chunker):
    retriever = Retriever(tmp_path, embedder)  # the default: SQLite in the index dir
    add(retriever, chunker, "gears", *DOCS["gears"])
    retriever.close()
    db = sqlite3.connect(tmp_path / DB_FILE)
    blob, n_tokens, embedding = db.execute("SELECT token_ids, n_tokens, embedding FROM chunks LIMIT 1").fetchone()
    assert len(blob) == 4 * n_tokens and len(embedding) == 4 * retriever.embedder.dim
    assert np.isclose(np.linalg.norm(np.frombuffer(embedding, "<f4")), 1.0)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_a_search_sees_only_the_askers_collection(tmp_path, retriever, chunker, open_retriever):
    """Collections (retrieval.documents: tenant): one FAISS file on disk holds every collection's chunks; a search
    keeps the asker's, however far down the nearest list they are, and the same id lives in two collections."""
    lamp = "Its lamp flashes white every 10 seconds and is seen from 22 nautical miles."
    for tenant in ("acme", "beta"):  # both have a "lighthouse" of their own, acme's only a far-off one
        chunks = chunker.chunk("lighthouse", lamp if tenant == "beta" else "Ferries leave the quay at nine.")
        retriever.add_document("lighthouse", chunks, title=f"{tenant} notes", tenant=tenant)
    for n in range(12):  # beta's many chunks that sit nearer the question than any of acme's
        add_to = chunker.chunk(f"lamp-{n}", f"The lamp of tower {n} flashes every {n + 2} seconds.")
        retriever.add_document(f"lamp-{n}", add_to, title="Lamps", tenant="beta")
    question = "How often does the lamp flash?"

    assert {h.chunk.doc_id for h in retriever.search(question, top_k=3)} <= set(DOCS)  # the shared collection
    acme = retriever.search(question, top_k=2, tenant="acme")
    assert [(h.chunk.doc_id, h.title) for h in acme] == [("lighthouse", "acme notes")]  # all acme has
    beta = retriever.search(question, top_k=3, tenant="beta")
    assert len(beta) == 3 and all(h.title in ("beta notes", "Lamps") for h in beta)
    assert retriever.search(question, tenant="nobody") == []

    assert [d.id for d in retriever.list_documents("acme")] == ["lighthouse"]
    assert retriever.get_document("lighthouse", "acme").title == "acme notes"
    assert retriever.get_document("lamp-0", "acme") is None and retriever.get_document("lamp-0", "beta")
    with pytest.raises(KeyError):
        retriever.delete_document("lamp-0", "acme")  # another collection's document is unknown here
    retriever.delete_document("lighthouse", "acme")
    assert retriever.get_document("lighthouse", "beta").title == "beta notes"
    assert retriever.get_document("lighthouse").title == DOCS["lighthouse"][0]

    reopened = open_retriever(tmp_path)  # the FAISS file on disk, lined up again, still filtered
    assert len(reopened) == len(retriever)
    assert retriever.search(question, tenant="acme") == [] and reopened.search(question, tenant="acme") == []
    assert {h.chunk.doc_id for h in reopened.search(question, top_k=13, tenant="beta")} == \
        {"lighthouse", *(f"lamp-{n}" for n in range(12))}
