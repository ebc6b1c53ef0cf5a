"""Documents and chunks in SQLite: the source of truth of the retrieval index.

Each chunk row keeps its embedding (float32 bytes), so the FAISS file is only a cache that can
always be rebuilt from here. Chunk ids come from AUTOINCREMENT and are never reused: the same
id always means the same vector, so "the index holds exactly the ids of this table" proves the
index is current. Token ids are stored as little-endian int32 bytes; nothing is pickled.
"""
from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from retrieval.chunker import Chunk

SCHEMA_VERSION = "1"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS documents (
    id TEXT PRIMARY KEY,
    title TEXT,
    source TEXT,
    content_hash TEXT NOT NULL,
    n_chunks INTEGER NOT NULL,
    ingested_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS chunks (
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
);
CREATE INDEX IF NOT EXISTS chunks_kv_key ON chunks (kv_key);
"""


@dataclass
class DocumentInfo:
    id: str
    title: str | None
    source: str | None
    content_hash: str  # sha256 of the document text
    n_chunks: int
    ingested_at: float  # unix seconds


_CHUNK_COLUMNS = "id, doc_id, ordinal, text, token_ids, content_hash, kv_key, start_char, end_char"


def _chunk(row: sqlite3.Row) -> Chunk:
    ids = np.frombuffer(row["token_ids"], dtype="<i4").tolist()
    return Chunk(row["doc_id"], row["ordinal"], row["text"], ids, row["start_char"], row["end_char"], id=row["id"],
                 kv_key=row["kv_key"])


class Metadata:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Autocommit mode; writes open their own transaction (see `_transaction`). The owner
        # serializes access across threads, hence check_same_thread=False.
        self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False, timeout=30.0)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        # WAL + NORMAL: a crash never corrupts the file; a power cut may drop the last commits.
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute("PRAGMA foreign_keys=ON")
        self.db.executescript(_SCHEMA)
        if self.get_meta("schema") is None:
            self.set_meta("schema", SCHEMA_VERSION)

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        self.db.execute("BEGIN IMMEDIATE")  # take the write lock now, not at the first write
        try:
            yield
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def data_version(self) -> int:
        """Changes whenever another connection (another process) commits."""
        return self.db.execute("PRAGMA data_version").fetchone()[0]

    def get_meta(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    def set_meta(self, key: str, value: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))

    # Documents -------------------------------------------------------------------------------
    def get_document(self, doc_id: str) -> DocumentInfo | None:
        row = self.db.execute("SELECT * FROM documents WHERE id = ?", (doc_id,)).fetchone()
        return None if row is None else DocumentInfo(**dict(row))

    def list_documents(self) -> list[DocumentInfo]:
        return [DocumentInfo(**dict(row)) for row in self.db.execute("SELECT * FROM documents ORDER BY id")]

    def replace_documents(self, docs: Sequence[tuple[DocumentInfo, Sequence[Chunk], np.ndarray]]
                          ) -> tuple[list[int], list[int], list[str]]:
        """Insert or replace each (document, its chunks, their embeddings), all in one transaction.

        Returns (new chunk ids, removed chunk ids, kv keys that no chunk references any more).
        """
        new_ids, old_ids, old_keys = [], [], set()
        with self._transaction():
            for doc, chunks, embeddings in docs:
                removed, keys = self._delete(doc.id)
                old_ids += removed
                old_keys.update(keys)
                self.db.execute("INSERT INTO documents VALUES (?, ?, ?, ?, ?, ?)",
                                (doc.id, doc.title, doc.source, doc.content_hash, doc.n_chunks, doc.ingested_at))
                new_ids += [self._insert_chunk(doc.id, chunk, vector)
                            for chunk, vector in zip(chunks, embeddings, strict=True)]
            return new_ids, old_ids, sorted(k for k in old_keys if not self.is_referenced(k))

    def _insert_chunk(self, doc_id: str, chunk: Chunk, vector: np.ndarray) -> int:
        cursor = self.db.execute(
            "INSERT INTO chunks (doc_id, ordinal, text, token_ids, n_tokens, content_hash, kv_key,"
            " start_char, end_char, embedding) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (doc_id, chunk.ordinal, chunk.text, np.asarray(chunk.token_ids, dtype="<i4").tobytes(),
             chunk.n_tokens, chunk.content_hash, chunk.kv_key, chunk.start, chunk.end,
             np.asarray(vector, dtype="<f4").tobytes()))
        return cursor.lastrowid

    def delete_document(self, doc_id: str) -> tuple[list[int], list[str]]:
        """Delete `doc_id` (KeyError if unknown); returns (removed chunk ids, now-unreferenced kv keys)."""
        with self._transaction():
            if self.db.execute("SELECT 1 FROM documents WHERE id = ?", (doc_id,)).fetchone() is None:
                raise KeyError(doc_id)
            old_ids, old_keys = self._delete(doc_id)
            return old_ids, [k for k in old_keys if not self.is_referenced(k)]

    def _delete(self, doc_id: str) -> tuple[list[int], list[str]]:
        rows = self.db.execute("SELECT id, kv_key FROM chunks WHERE doc_id = ?", (doc_id,)).fetchall()
        self.db.execute("DELETE FROM chunks WHERE doc_id = ?", (doc_id,))
        self.db.execute("DELETE FROM documents WHERE id = ?", (doc_id,))
        return [r["id"] for r in rows], sorted({r["kv_key"] for r in rows if r["kv_key"]})

    def is_referenced(self, kv_key: str) -> bool:
        """Whether any chunk uses this KV entry (two documents, or two versions, can share a chunk)."""
        return self.db.execute("SELECT 1 FROM chunks WHERE kv_key = ? LIMIT 1", (kv_key,)).fetchone() is not None

    # Chunks ----------------------------------------------------------------------------------
    def document_chunks(self, doc_id: str) -> list[Chunk]:
        rows = self.db.execute(f"SELECT {_CHUNK_COLUMNS} FROM chunks WHERE doc_id = ? ORDER BY ordinal", (doc_id,))
        return [_chunk(row) for row in rows]

    def chunks_with_titles(self, ids: Sequence[int]) -> dict[int, tuple[Chunk, str | None]]:
        if not ids:
            return {}
        marks = ",".join("?" * len(ids))
        rows = self.db.execute(
            f"SELECT c.id, c.doc_id, c.ordinal, c.text, c.token_ids, c.content_hash, c.kv_key, c.start_char,"
            f" c.end_char, d.title FROM chunks c JOIN documents d ON d.id = c.doc_id WHERE c.id IN ({marks})",
            [int(i) for i in ids])
        return {row["id"]: (_chunk(row), row["title"]) for row in rows}

    def chunk_ids(self) -> np.ndarray:
        return np.array([r[0] for r in self.db.execute("SELECT id FROM chunks ORDER BY id")], dtype=np.int64)

    def embeddings(self, dim: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids [n], vectors [n, dim]) of every chunk, to rebuild the FAISS index."""
        rows = self.db.execute("SELECT id, embedding FROM chunks ORDER BY id").fetchall()
        ids = np.array([r[0] for r in rows], dtype=np.int64)
        vectors = np.frombuffer(b"".join(r[1] for r in rows), dtype="<f4").reshape(len(rows), dim)
        return ids, vectors.astype(np.float32)
