"""Metadata in one SQLite file: the embedded default (one machine; `ragblend ingest` may write
while the server runs). WAL mode: readers never block the writer, a crash never corrupts."""
from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from retrieval.metadata import CHUNKS, Metadata

# Version 1 is the schema ragblend started with (IF NOT EXISTS: a database made before versioning,
# which recorded meta.schema = "1", adopts it as is).
_V1 = (
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE IF NOT EXISTS documents (
        id TEXT PRIMARY KEY,
        title TEXT,
        source TEXT,
        content_hash TEXT NOT NULL,
        n_chunks INTEGER NOT NULL,
        ingested_at REAL NOT NULL
    )""",
    # AUTOINCREMENT: ids are never reused, so one id always means one vector.
    """CREATE TABLE IF NOT EXISTS chunks (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        doc_id TEXT NOT NULL REFERENCES documents(id) ON DELETE CASCADE,
        ordinal INTEGER NOT NULL,
        text TEXT NOT NULL,
        token_ids BLOB NOT NULL,
        n_tokens INTEGER NOT NULL,
        content_hash TEXT NOT NULL,
        kv_key TEXT,
        start_char INTEGER NOT NULL,
        end_char INTEGER NOT NULL,
        embedding BLOB NOT NULL,
        UNIQUE (doc_id, ordinal)
    )""",
    "CREATE INDEX IF NOT EXISTS chunks_kv_key ON chunks (kv_key)",
)
# Version 2: the deletions log that lets an index catch up, and KV usage counts.
_V2 = (
    "CREATE TABLE deletions (seq INTEGER PRIMARY KEY AUTOINCREMENT, chunk_id INTEGER NOT NULL)",
    "CREATE TABLE kv_served (source TEXT PRIMARY KEY, chunks INTEGER NOT NULL)",
    """CREATE TABLE kv_usage (
        kv_key TEXT PRIMARY KEY,
        hits INTEGER NOT NULL,
        computes INTEGER NOT NULL,
        last_used REAL NOT NULL
    )""",
    "DELETE FROM meta WHERE key = 'schema'",  # the pre-versioning marker; schema_version says it now
)
# Version 3: KV leases (store/leases.py), one row per (family, key, tier) a lease holds.
_V3 = (
    """CREATE TABLE kv_leases (
        family TEXT NOT NULL,
        kv_key TEXT NOT NULL,
        tier TEXT NOT NULL,
        nbytes INTEGER NOT NULL,
        ttl_s REAL NOT NULL,
        soft INTEGER NOT NULL,
        expires_at REAL NOT NULL,
        PRIMARY KEY (family, kv_key, tier)
    )""",
    "CREATE INDEX kv_leases_key ON kv_leases (kv_key)",
    "CREATE INDEX kv_leases_expiry ON kv_leases (expires_at)",
)
# Version 4: documents per tenant (`retrieval.documents: tenant`): a document is (tenant, id), "" the shared
# collection every older row joins. SQLite cannot change a primary key, so both tables are rebuilt: the old
# ones renamed (the chunks' foreign key follows), rows copied with their ids, the id sequence carried over
# (chunk ids are never reused), the old tables dropped (child first: nothing cascades).
_V4 = (
    "ALTER TABLE chunks RENAME TO chunks_v3",
    "ALTER TABLE documents RENAME TO documents_v3",
    """CREATE TABLE documents (
        tenant TEXT NOT NULL DEFAULT '',
        id TEXT NOT NULL,
        title TEXT,
        source TEXT,
        content_hash TEXT NOT NULL,
        n_chunks INTEGER NOT NULL,
        ingested_at REAL NOT NULL,
        PRIMARY KEY (tenant, id)
    )""",
    """CREATE TABLE chunks (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        tenant TEXT NOT NULL DEFAULT '',
        doc_id TEXT NOT NULL,
        ordinal INTEGER NOT NULL,
        text TEXT NOT NULL,
        token_ids BLOB NOT NULL,
        n_tokens INTEGER NOT NULL,
        content_hash TEXT NOT NULL,
        kv_key TEXT,
        start_char INTEGER NOT NULL,
        end_char INTEGER NOT NULL,
        embedding BLOB NOT NULL,
        FOREIGN KEY (tenant, doc_id) REFERENCES documents (tenant, id) ON DELETE CASCADE,
        UNIQUE (tenant, doc_id, ordinal)
    )""",
    "INSERT INTO documents (id, title, source, content_hash, n_chunks, ingested_at)"
    " SELECT id, title, source, content_hash, n_chunks, ingested_at FROM documents_v3",
    "INSERT INTO chunks (id, doc_id, ordinal, text, token_ids, n_tokens, content_hash, kv_key, start_char, end_char,"
    " embedding) SELECT id, doc_id, ordinal, text, token_ids, n_tokens, content_hash, kv_key, start_char, end_char,"
    " embedding FROM chunks_v3",
    "DELETE FROM sqlite_sequence WHERE name = 'chunks'",
    "INSERT INTO sqlite_sequence (name, seq) SELECT 'chunks', seq FROM sqlite_sequence WHERE name = 'chunks_v3'",
    "DROP TABLE chunks_v3",
    "DROP TABLE documents_v3",
    "CREATE INDEX chunks_kv_key ON chunks (kv_key)",
)


class SQLiteMetadata(Metadata):
    backend = "sqlite"
    MIGRATIONS = (_V1, _V2, _V3, _V4)

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Autocommit mode: every transaction is explicit (`_write`, `_snapshot`). One connection is
        # shared by the threads of a process (the worker, the usage flusher): `_lock` takes turns.
        self.db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False, timeout=30.0)
        self._lock = threading.RLock()
        self.db.execute("PRAGMA journal_mode=WAL")
        # WAL + NORMAL: a crash never corrupts the file; a power cut may drop the last commits.
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute("PRAGMA foreign_keys=ON")
        self._migrate()

    def where(self) -> str:
        return str(self.path)

    def close(self) -> None:
        with self._lock:
            self.db.close()

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            yield self.db

    @contextmanager
    def _snapshot(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self.db.execute("BEGIN")  # in WAL mode a read transaction sees one snapshot
            try:
                yield self.db
            finally:
                self.db.execute("COMMIT")

    @contextmanager
    def _write(self, serial: str | None = CHUNKS) -> Iterator[sqlite3.Connection]:
        # SQLite has one writer at a time anyway: every write is serialized with every other.
        with self._lock:
            self.db.execute("BEGIN IMMEDIATE")  # take the write lock now, not at the first write
            try:
                yield self.db
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")
