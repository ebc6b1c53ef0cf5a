"""The Metadata contract, against SQLite and a real PostgreSQL alike: versioned migrations,
all-or-nothing writes (a killed writer included), ids in commit order, the change log an index
follows, and KV usage counts."""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from retrieval import Chunk, DocumentInfo, SchemaError, open_metadata
from retrieval.metadata import Marks

REPO = Path(__file__).resolve().parents[2]
DIM = 8


def doc(doc_id: str, n: int, keys: list[str] | None = None, seed: int = 0):
    """(DocumentInfo, n chunks, their unit vectors [n, DIM]) as Retriever.add_documents takes them."""
    chunks = [Chunk(doc_id, i, f"{doc_id} chunk {i}", [i, 1000 + i, 70000], 10 * i, 10 * i + 9,
                    kv_key=(keys or [f"{doc_id}-{j}" for j in range(n)])[i]) for i in range(n)]
    vectors = np.random.default_rng(seed).normal(size=(n, DIM)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return DocumentInfo(doc_id, f"Title {doc_id}", f"{doc_id}.md", f"hash-{doc_id}", n, 1.0e9), chunks, vectors


def test_schema_is_versioned_and_migrated_once(open_db):
    first = open_db()
    latest = len(first.MIGRATIONS)
    assert first.schema_version() == latest >= 2
    second = open_db()  # a second replica opening the same database applies nothing
    assert second.schema_version() == latest
    with first._read() as db:
        assert [r[0] for r in db.execute("SELECT version FROM schema_version ORDER BY version").fetchall()] == \
            list(range(1, latest + 1))
    with first._write() as db:  # as if a newer ragblend had migrated it further
        db.execute("INSERT INTO schema_version (version, applied_at) VALUES (?, ?)", (latest + 1, 0.0))
    with pytest.raises(SchemaError, match=f"schema version {latest + 1}"):
        open_db()


def test_a_database_from_before_versioning_is_migrated_in_place(tmp_path):
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)  # the schema and rows ragblend wrote before schema_version existed
    db.executescript("""
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE documents (id TEXT PRIMARY KEY, title TEXT, source TEXT, content_hash TEXT NOT NULL,
                                n_chunks INTEGER NOT NULL, ingested_at REAL NOT NULL);
        CREATE TABLE chunks (id INTEGER PRIMARY KEY AUTOINCREMENT,
            doc_id TEXT NOT NULL REFERENCES documents(id) ON DELETE CASCADE, ordinal INTEGER NOT NULL,
            text TEXT NOT NULL, token_ids BLOB NOT NULL, n_tokens INTEGER NOT NULL, content_hash TEXT NOT NULL,
            kv_key TEXT, start_char INTEGER NOT NULL, end_char INTEGER NOT NULL, embedding BLOB NOT NULL,
            UNIQUE (doc_id, ordinal));
        INSERT INTO meta VALUES ('schema', '1'), ('embedder', 'e dim=8');
        INSERT INTO documents VALUES ('old', 'Old', 'old.md', 'h', 1, 1.0);
    """)
    db.execute("INSERT INTO chunks (doc_id, ordinal, text, token_ids, n_tokens, content_hash, kv_key, start_char,"
               " end_char, embedding) VALUES ('old', 0, 'text', ?, 2, 'h', 'k', 0, 4, ?)",
               (np.array([5, 6], "<i4").tobytes(), np.ones(DIM, "<f4").tobytes()))
    db.commit()
    db.close()
    metadata = open_metadata(f"sqlite:///{path}", tmp_path)
    assert metadata.schema_version() == len(metadata.MIGRATIONS)
    assert metadata.get_meta("embedder") == "e dim=8" and metadata.get_meta("schema") is None
    assert [c.token_ids for c in metadata.document_chunks("old")] == [[5, 6]]
    assert metadata.delete_document("old") == ["k"]  # the new deletions log works on old rows
    assert metadata.marks() == Marks(chunk_id=0, deletion=1)
    metadata.close()


def test_chunks_round_trip_and_missing_ids_are_left_out(open_db):
    metadata = open_db()
    info, chunks, vectors = doc("a", 3)
    assert metadata.replace_documents([(info, chunks, vectors)]) == []
    assert metadata.get_document("a") == info and [d.id for d in metadata.list_documents()] == ["a"]
    stored = metadata.document_chunks("a")
    assert [(c.ordinal, c.text, c.token_ids, c.start, c.end, c.kv_key) for c in stored] == \
        [(c.ordinal, c.text, c.token_ids, c.start, c.end, c.kv_key) for c in chunks]
    ids = [c.id for c in stored]
    assert ids == sorted(ids) and list(metadata.chunk_ids()) == ids and metadata.count_chunks() == 3
    rows = metadata.chunks_with_titles([ids[2], 10**9, ids[0]])
    assert sorted(rows) == [ids[0], ids[2]] and rows[ids[2]][1] == "Title a" and rows[ids[2]][0].text == "a chunk 2"
    got_ids, got = metadata.vectors([ids[1], 10**9], DIM)
    assert list(got_ids) == [ids[1]] and np.array_equal(got[0], vectors[1])


def test_replace_and_delete_log_every_removed_chunk(open_db):
    metadata = open_db()
    assert metadata.marks() == Marks(0, 0)
    metadata.replace_documents([doc("a", 2), doc("b", 2, keys=["shared", "b-1"])])
    start = metadata.marks()
    old_a = [c.id for c in metadata.document_chunks("a")]
    # A new version of "a" keeps key a-0, drops a-1, and now shares b's key "shared".
    stale = metadata.replace_documents([doc("a", 2, keys=["a-0", "shared"], seed=1)])
    assert stale == ["a-1"]
    new_a = [c.id for c in metadata.document_chunks("a")]
    assert min(new_a) > start.chunk_id  # ids are never reused: a new version gets new ones
    changes = metadata.changes_since(start, DIM)
    assert list(changes.deleted) == old_a and list(changes.ids) == new_a and changes.vectors.shape == (2, DIM)
    assert changes.marks == metadata.marks() == Marks(max(new_a), 2)

    assert metadata.delete_document("b") == ["b-1"]  # "shared" is still used by "a"
    assert metadata.is_referenced("shared") and not metadata.is_referenced("b-1")
    with pytest.raises(KeyError):
        metadata.delete_document("b")
    later = metadata.changes_since(changes.marks, DIM)
    assert len(later.deleted) == 2 and len(later.ids) == 0 and later.marks.deletion == 4
    marks, ids = metadata.snapshot_ids()
    assert marks == later.marks and list(ids) == new_a


def test_a_failed_write_leaves_nothing(open_db):
    metadata = open_db()
    metadata.replace_documents([doc("a", 1)])
    before = metadata.marks()
    info, chunks, vectors = doc("c", 2)
    chunks[1].ordinal = 0  # violates UNIQUE (doc_id, ordinal) after "b" went in
    with pytest.raises(Exception, match="(?i)unique"):
        metadata.replace_documents([doc("b", 2), (info, chunks, vectors)])
    assert [d.id for d in metadata.list_documents()] == ["a"]
    assert metadata.count_chunks() == 1 and metadata.marks() == before


def test_writers_commit_in_id_order_so_a_reader_never_misses_a_chunk(open_db):
    first, second, reader = open_db(), open_db(), open_db()
    inside, release = threading.Event(), threading.Event()
    insert = type(first)._insert_chunks

    def slow_insert(db, *args):  # the first writer stops inside its transaction, its chunks inserted
        insert(first, db, *args)
        inside.set()
        assert release.wait(30)
    first._insert_chunks = slow_insert
    threads = [threading.Thread(target=first.replace_documents, args=([doc("early", 2)],))]
    threads[0].start()
    assert inside.wait(30)
    threads.append(threading.Thread(target=second.replace_documents, args=([doc("late", 2)],)))
    threads[1].start()
    threads[1].join(0.5)
    assert threads[1].is_alive(), "the second writer must wait for the first to commit"
    assert reader.marks() == Marks(0, 0)  # nothing committed is visible yet
    release.set()
    for thread in threads:
        thread.join(30)
    early = [c.id for c in reader.document_chunks("early")]
    late = [c.id for c in reader.document_chunks("late")]
    assert max(early) < min(late)  # commit order is id order
    assert list(reader.changes_since(Marks(0, 0), DIM).ids) == early + late


KILLED_WRITER = """
import sys, time
sys.path.insert(0, {repo!r})
from retrieval import open_metadata
from tests.retrieval.test_retrieval_metadata import doc

metadata = open_metadata({url!r}, {tmp!r})
insert = type(metadata)._insert_chunks
def stuck(db, *args):
    insert(metadata, db, *args)
    print("inside", flush=True)
    time.sleep(600)
metadata._insert_chunks = stuck
metadata.replace_documents([doc("replaced", 3, seed=2), doc("new", 2)])
"""


def test_a_writer_killed_mid_transaction_leaves_the_collection_as_it_was(open_db, database_url, tmp_path):
    metadata = open_db()
    metadata.replace_documents([doc("replaced", 2)])
    before = (metadata.marks(), metadata.document_chunks("replaced"))
    script = KILLED_WRITER.format(repo=str(REPO), url=database_url, tmp=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], stdout=subprocess.PIPE, text=True,
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert proc.stdout.readline().strip() == "inside"  # its first document is written, uncommitted
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert (metadata.marks(), metadata.document_chunks("replaced")) == before
    assert [d.id for d in metadata.list_documents()] == ["replaced"]
    metadata.replace_documents([doc("after", 1)])  # the dead writer's lock is gone
    assert metadata.get_document("after") is not None


def test_usage_adds_up_across_replicas_and_goes_with_the_last_chunk(open_db):
    one, two = open_db(), open_db()
    one.replace_documents([doc("a", 2)])
    one.record_usage({"computed": 2}, {"a-0": (0, 1, 100.0), "a-1": (0, 1, 100.0)})
    two.record_usage({"redis": 1, "memory": 2}, {"a-0": (3, 0, 250.0)})
    one.record_usage({"memory": 1}, {"a-0": (1, 0, 200.0)})  # an older last use does not win
    usage = two.usage(top=1)
    assert usage["served"] == {"computed": 2, "memory": 3, "redis": 1} and usage["entries_used"] == 2
    assert usage["top"] == [{"kv_key": "a-0", "hits": 4, "computes": 1, "last_used": 250.0, "doc_id": "a"}]
    assert one.kv_usage("a-1") == (0, 1, 100.0) and one.kv_usage("nope") is None
    one.replace_documents([doc("a", 1)])  # a-1 is used by no chunk any more
    assert one.kv_usage("a-1") is None and one.kv_usage("a-0") == (4, 1, 250.0)
    assert one.usage()["served"]["computed"] == 2  # totals are history: they stay


def test_unknown_database_urls_are_refused(tmp_path):
    with pytest.raises(ValueError, match="postgresql://"):
        open_metadata("mysql://u@h/db", tmp_path)


def test_collections_keep_the_same_id_apart(open_db):
    """A document is (tenant, id): the same id in two tenants' collections and the shared one ("") are three
    documents; reads, replaces and deletes of one leave the others."""
    metadata = open_db()
    metadata.replace_documents([doc("a", 2)])
    metadata.replace_documents([doc("a", 1, keys=["acme-a"])], tenant="acme")
    metadata.replace_documents([doc("a", 3, keys=["beta-0", "beta-1", "acme-a"]), doc("b", 1)], tenant="beta")
    assert [d.n_chunks for d in (metadata.get_document("a"), metadata.get_document("a", "acme"),
                                 metadata.get_document("a", "beta"))] == [2, 1, 3]
    assert [d.id for d in metadata.list_documents("beta")] == ["a", "b"]
    assert [d.id for d in metadata.list_documents()] == ["a"] and metadata.list_documents("nobody") == []
    assert metadata.get_document("b") is None and metadata.get_document("b", "acme") is None
    assert [c.kv_key for c in metadata.document_chunks("a", "acme")] == ["acme-a"]
    ids = list(metadata.chunk_ids())
    assert sorted(r[0].kv_key for r in metadata.chunks_with_titles(ids, "beta").values()) == \
        ["acme-a", "b-0", "beta-0", "beta-1"]
    assert len(metadata.chunks_with_titles(ids)) == 2 and metadata.chunks_with_titles(ids, "nobody") == {}

    with pytest.raises(KeyError):
        metadata.delete_document("b", "acme")
    assert metadata.delete_document("a", "acme") == []  # "acme-a" is still a beta chunk's key
    assert metadata.get_document("a", "beta") and metadata.get_document("a")
    assert metadata.delete_document("a", "beta") == ["acme-a", "beta-0", "beta-1"]
    assert [d.id for d in metadata.list_documents("beta")] == ["b"] and metadata.count_chunks() == 3


def test_a_version_3_database_opens_with_its_documents_shared(database_url, tmp_path):
    """A database from before collections (schema 3) migrates in place: its documents are the shared collection,
    chunk ids and the change log are kept, and a new chunk never takes the id of one deleted before."""
    from retrieval.postgres import PostgresMetadata
    from retrieval.sqlite import SQLiteMetadata

    if database_url.startswith("sqlite"):
        path = tmp_path / "v3.sqlite"
        database_url = f"sqlite:///{path}"
        old = type("V3", (SQLiteMetadata,), {"MIGRATIONS": SQLiteMetadata.MIGRATIONS[:3]})(path)
    else:
        old = type("V3", (PostgresMetadata,), {"MIGRATIONS": PostgresMetadata.MIGRATIONS[:3]})(database_url)
    assert old.schema_version() == 3
    with old._write() as db:  # rows as ragblend wrote them at schema 3
        db.execute("INSERT INTO documents (id, title, source, content_hash, n_chunks, ingested_at)"
                   " VALUES ('old', 'Old', 'old.md', 'h', 1, 1.0)")
        for ordinal in range(3):
            db.execute("INSERT INTO chunks (doc_id, ordinal, text, token_ids, n_tokens, content_hash, kv_key,"
                       " start_char, end_char, embedding) VALUES ('old', ?, 'text', ?, 2, 'h', ?, 0, 4, ?)",
                       (ordinal, np.array([5, 6], "<i4").tobytes(), f"k{ordinal}", np.ones(DIM, "<f4").tobytes()))
        top = db.execute("SELECT MAX(id) FROM chunks").fetchone()[0]
        db.execute("INSERT INTO deletions (chunk_id) VALUES (?)", (top,))
        db.execute("DELETE FROM chunks WHERE id = ?", (top,))  # the highest id, deleted: never to be reused
    marks = old.marks()
    old.close()

    metadata = open_metadata(database_url, tmp_path)
    assert metadata.schema_version() == len(metadata.MIGRATIONS) == 4
    assert metadata.marks() == marks and metadata.get_document("old").title == "Old"
    assert [c.kv_key for c in metadata.document_chunks("old")] == ["k0", "k1"]
    metadata.replace_documents([doc("new", 1)], tenant="acme")
    assert metadata.document_chunks("new", "acme")[0].id > top
    assert metadata.get_document("old", "acme") is None
    assert metadata.delete_document("old") == ["k0", "k1"]
    metadata.close()
