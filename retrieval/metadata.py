"""Documents and chunks in SQL, the source of truth of the retrieval index: SQLite (embedded, the
default) or PostgreSQL (shared by replicas, retrieval/postgres.py). `Metadata` holds every query;
a backend brings its connections, its DDL and its transactions; retrieval/backends.py opens one by URL.

Contract (tests/retrieval/test_retrieval_metadata.py runs it against both backends):
- Each chunk row keeps its embedding (float32 bytes), so a FAISS index is only a cache that can
  always be rebuilt or caught up from here. Token ids are little-endian int32 bytes; no pickle.
- Writers are serialized (SQLite's write lock; in PostgreSQL an advisory lock taken first in every
  write transaction), so chunk ids, which are never reused, grow in commit order: every chunk a
  reader has not seen has an id above the highest id it has seen. Every removed chunk id is
  appended to `deletions`, whose `seq` grows the same way. `marks()` reads both high-water marks
  in one cheap query; `changes_since(marks)` returns what happened after them.
- `replace_documents` and `delete_document` are one transaction each: all or nothing, also when
  the writing process is killed.
- Documents belong to a tenant's collection: a document is (tenant, id), "" the shared collection (every
  row from before version 4). Each document method and the search's `chunks_with_titles` see one
  collection; the change log and the FAISS index that follows it hold every collection's chunks.
- Schema versions: `schema_version` lists the migrations applied; opening applies the missing
  ones in order under the write lock (replicas starting together migrate once) and refuses a
  database migrated by a newer ragblend.
- KV usage (which retrieved chunks were served from which store tier, which were computed) is
  counted here too: per source in `kv_served`, per KV entry in `kv_usage` (hits, computes, last
  use). It lives with the chunks, so every replica adds to the same numbers and the CLI reads them.
- KV leases (store/leases.py's `LeaseLedger`, which this class satisfies without importing store): one
  `kv_leases` row per (family, kv key, tier) a lease holds, with the entry's bytes in that tier, its
  ttl, whether a hit renews it (soft) and when it ends. Every lease change is one transaction serialized
  under LEASES, so a tier's cap is checked and filled by one writer at a time across replicas; a lease
  that has ended is ignored by every query the moment it ends, and deleted by the next `expire_leases`.
"""
from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from retrieval.chunker import Chunk

log = logging.getLogger("ragblend.retrieval")

DB_FILE = "metadata.sqlite"  # the SQLite default, under the index dir
_ID_BATCH = 1000  # ids per `IN (...)` list: well under SQLite's and PostgreSQL's parameter limits
CHUNKS, LEASES = "chunks", "leases"  # the writers that must take turns (`_write`'s `serial`)


class SchemaError(RuntimeError):
    """The database was migrated by a newer ragblend than this one."""


@dataclass
class DocumentInfo:
    id: str
    title: str | None
    source: str | None
    content_hash: str  # sha256 of the document text
    n_chunks: int
    ingested_at: float  # unix seconds


@dataclass(frozen=True)
class Marks:
    """How far a reader has followed the collection: the highest chunk id and deletion seq seen."""

    chunk_id: int = 0
    deletion: int = 0


@dataclass
class Changes:
    """What was committed after some marks: removed chunk ids, then added chunks with their vectors."""

    marks: Marks  # the marks after these changes
    deleted: np.ndarray  # [n] int64
    ids: np.ndarray  # [m] int64
    vectors: np.ndarray  # [m, dim] float32


class Connection(Protocol):
    """What the queries need from a connection: `?` placeholders, rows as tuples."""

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any: ...
    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> Any: ...


_DOC_COLUMNS = "id, title, source, content_hash, n_chunks, ingested_at"
_CHUNK_COLUMNS = "c.id, c.doc_id, c.ordinal, c.text, c.token_ids, c.kv_key, c.start_char, c.end_char"


def _chunk(row: Sequence[Any]) -> Chunk:
    chunk_id, doc_id, ordinal, text, token_ids, kv_key, start, end = row[:8]
    ids = np.frombuffer(token_ids, dtype="<i4").tolist()
    return Chunk(doc_id, ordinal, text, ids, start, end, id=chunk_id, kv_key=kv_key)


def _vectors(rows: Sequence[Sequence[Any]], dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids [n], vectors [n, dim]) from (id, embedding bytes) rows."""
    ids = np.array([r[0] for r in rows], dtype=np.int64)
    vectors = np.frombuffer(b"".join(bytes(r[1]) for r in rows), dtype="<f4").reshape(len(rows), dim)
    return ids, vectors.astype(np.float32)


class Metadata(ABC):
    """Documents, chunks, their change log and KV usage; see the module docstring for the contract."""

    backend: str  # "sqlite" | "postgresql"
    MIGRATIONS: tuple[tuple[str, ...], ...]  # statements of schema versions 1, 2, ... in order

    # What a backend provides -----------------------------------------------------------------
    @abstractmethod
    def _read(self) -> AbstractContextManager[Connection]:
        """A connection for single-statement reads."""

    @abstractmethod
    def _snapshot(self) -> AbstractContextManager[Connection]:
        """A read-only transaction: every statement sees the same committed state."""

    @abstractmethod
    def _write(self, serial: str | None = CHUNKS) -> AbstractContextManager[Connection]:
        """A transaction, committed on exit, rolled back on an exception. `serial`: serialized with every
        other writer of that name (CHUNKS: anything that adds or removes chunks must be; LEASES: lease
        changes, so a tier's pinned bytes are summed and added to by one writer at a time); None: no order."""

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def where(self) -> str:
        """Where the data lives, for messages (never a password)."""

    # Schema ----------------------------------------------------------------------------------
    VERSION_TABLE = ("CREATE TABLE IF NOT EXISTS schema_version"
                     " (version INTEGER PRIMARY KEY, applied_at DOUBLE PRECISION NOT NULL)")

    def _migrate(self) -> None:
        """Apply the migrations this database lacks, in order, in one transaction."""
        with self._write() as db:
            db.execute(self.VERSION_TABLE)
            current = db.execute("SELECT COALESCE(MAX(version), 0) FROM schema_version").fetchone()[0]
            latest = len(self.MIGRATIONS)
            if current > latest:
                raise SchemaError(f"{self.where()} has schema version {current}, newer than this ragblend's "
                                  f"{latest}: upgrade ragblend")
            for version in range(current + 1, latest + 1):
                for statement in self.MIGRATIONS[version - 1]:
                    db.execute(statement)
                db.execute("INSERT INTO schema_version (version, applied_at) VALUES (?, ?)", (version, time.time()))
                log.info("metadata schema migrated", extra={"where": self.where(), "version": version})

    def schema_version(self) -> int:
        with self._read() as db:
            return db.execute("SELECT COALESCE(MAX(version), 0) FROM schema_version").fetchone()[0]

    def get_meta(self, key: str) -> str | None:
        with self._read() as db:
            row = db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    def set_meta(self, key: str, value: str) -> None:
        with self._write(serial=None) as db:
            db.execute("INSERT INTO meta (key, value) VALUES (?, ?)"
                       " ON CONFLICT (key) DO UPDATE SET value = excluded.value", (key, value))

    # Documents -------------------------------------------------------------------------------
    def get_document(self, doc_id: str, tenant: str = "") -> DocumentInfo | None:
        with self._read() as db:
            row = db.execute(f"SELECT {_DOC_COLUMNS} FROM documents WHERE tenant = ? AND id = ?",
                             (tenant, doc_id)).fetchone()
        return None if row is None else DocumentInfo(*row)

    def list_documents(self, tenant: str = "") -> list[DocumentInfo]:
        with self._read() as db:
            return [DocumentInfo(*row) for row in db.execute(
                f"SELECT {_DOC_COLUMNS} FROM documents WHERE tenant = ? ORDER BY id", (tenant,))]

    def replace_documents(self, docs: Sequence[tuple[DocumentInfo, Sequence[Chunk], np.ndarray]],
                          tenant: str = "") -> list[str]:
        """Insert or replace each (document, its chunks, their embeddings) of `tenant`'s collection, all in one
        transaction. Returns the kv keys that no chunk references any more.
        """
        old_keys: set[str] = set()
        with self._write() as db:
            for doc, chunks, embeddings in docs:
                old_keys |= self._delete(db, doc.id, tenant)
                db.execute(f"INSERT INTO documents (tenant, {_DOC_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
                           (tenant, doc.id, doc.title, doc.source, doc.content_hash, doc.n_chunks, doc.ingested_at))
                self._insert_chunks(db, doc.id, tenant, chunks, embeddings)
            return self._unreferenced(db, old_keys)

    def _insert_chunks(self, db: Connection, doc_id: str, tenant: str, chunks: Sequence[Chunk],
                       embeddings: np.ndarray) -> None:
        rows = [(tenant, doc_id, c.ordinal, c.text, np.asarray(c.token_ids, dtype="<i4").tobytes(), c.n_tokens,
                 c.content_hash, c.kv_key, c.start, c.end, np.asarray(vector, dtype="<f4").tobytes())
                for c, vector in zip(chunks, embeddings, strict=True)]
        db.executemany("INSERT INTO chunks (tenant, doc_id, ordinal, text, token_ids, n_tokens, content_hash, kv_key,"
                       " start_char, end_char, embedding) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)

    def delete_document(self, doc_id: str, tenant: str = "") -> list[str]:
        """Delete `doc_id` of `tenant`'s collection (KeyError if it has none); returns the kv keys no chunk
        references any more."""
        with self._write() as db:
            if db.execute("SELECT 1 FROM documents WHERE tenant = ? AND id = ?", (tenant, doc_id)).fetchone() is None:
                raise KeyError(doc_id)
            return self._unreferenced(db, self._delete(db, doc_id, tenant))

    @staticmethod
    def _delete(db: Connection, doc_id: str, tenant: str) -> set[str]:
        """Remove a document and its chunks, logging each chunk id; returns the chunks' kv keys."""
        doc = (tenant, doc_id)
        keys = {r[0] for r in db.execute("SELECT kv_key FROM chunks WHERE tenant = ? AND doc_id = ?"
                                         " AND kv_key IS NOT NULL", doc)}
        db.execute("INSERT INTO deletions (chunk_id) SELECT id FROM chunks WHERE tenant = ? AND doc_id = ?"
                   " ORDER BY id", doc)
        db.execute("DELETE FROM chunks WHERE tenant = ? AND doc_id = ?", doc)
        db.execute("DELETE FROM documents WHERE tenant = ? AND id = ?", doc)
        return keys

    @staticmethod
    def _unreferenced(db: Connection, keys: set[str]) -> list[str]:
        """The keys no chunk uses any more (two documents, or two versions, can share a chunk's KV);
        their usage rows go with them."""
        stale = sorted(k for k in keys if db.execute("SELECT 1 FROM chunks WHERE kv_key = ? LIMIT 1", (k,)).fetchone()
                       is None)
        db.executemany("DELETE FROM kv_usage WHERE kv_key = ?", [(k,) for k in stale])
        return stale

    def is_referenced(self, kv_key: str) -> bool:
        """Whether any chunk uses this KV entry."""
        with self._read() as db:
            return db.execute("SELECT 1 FROM chunks WHERE kv_key = ? LIMIT 1", (kv_key,)).fetchone() is not None

    # Chunks ----------------------------------------------------------------------------------
    def document_chunks(self, doc_id: str, tenant: str = "") -> list[Chunk]:
        with self._read() as db:
            rows = db.execute(f"SELECT {_CHUNK_COLUMNS} FROM chunks c WHERE c.tenant = ? AND c.doc_id = ?"
                              " ORDER BY c.ordinal", (tenant, doc_id)).fetchall()
        return [_chunk(row) for row in rows]

    def chunks_with_titles(self, ids: Sequence[int], tenant: str = "") -> dict[int, tuple[Chunk, str | None]]:
        """The chunks of `ids` that still exist in `tenant`'s collection, with their document's title."""
        rows: list[Sequence[Any]] = []
        with self._read() as db:
            for i in range(0, len(ids), _ID_BATCH):
                batch = [int(x) for x in ids[i:i + _ID_BATCH]]
                rows += db.execute(f"SELECT {_CHUNK_COLUMNS}, d.title FROM chunks c JOIN documents d"
                                   f" ON d.tenant = c.tenant AND d.id = c.doc_id"
                                   f" WHERE c.tenant = ? AND c.id IN ({','.join('?' * len(batch))})",
                                   [tenant, *batch]).fetchall()
        return {row[0]: (_chunk(row), row[8]) for row in rows}

    def chunk_ids(self) -> np.ndarray:
        with self._read() as db:
            return np.array([r[0] for r in db.execute("SELECT id FROM chunks ORDER BY id").fetchall()], dtype=np.int64)

    def count_chunks(self) -> int:
        with self._read() as db:
            return db.execute("SELECT COUNT(*) FROM chunks").fetchone()[0]

    # Following the collection (a FAISS index per process) ---------------------------------------
    _MARKS = "SELECT (SELECT COALESCE(MAX(id), 0) FROM chunks), (SELECT COALESCE(MAX(seq), 0) FROM deletions)"

    def marks(self) -> Marks:
        """The current high-water marks: one cheap query (two index lookups), run before each search."""
        with self._read() as db:
            return Marks(*db.execute(self._MARKS).fetchone())

    def snapshot_ids(self) -> tuple[Marks, np.ndarray]:
        """The marks and every chunk id, at one instant (to line an index up with the table)."""
        with self._snapshot() as db:
            marks = Marks(*db.execute(self._MARKS).fetchone())
            ids = np.array([r[0] for r in db.execute("SELECT id FROM chunks ORDER BY id").fetchall()], dtype=np.int64)
        return marks, ids

    def vectors(self, ids: Sequence[int], dim: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids [n], vectors [n, dim]) of those of `ids` that still exist."""
        rows: list[Sequence[Any]] = []
        with self._read() as db:
            for i in range(0, len(ids), _ID_BATCH):
                batch = [int(x) for x in ids[i:i + _ID_BATCH]]
                rows += db.execute(f"SELECT id, embedding FROM chunks WHERE id IN ({','.join('?' * len(batch))})"
                                   f" ORDER BY id", batch).fetchall()
        return _vectors(rows, dim)

    def changes_since(self, marks: Marks, dim: int) -> Changes:
        """Chunks deleted and added after `marks`, read at one instant, with the marks they lead to."""
        with self._snapshot() as db:
            now = Marks(*db.execute(self._MARKS).fetchone())
            deleted = [r[0] for r in db.execute("SELECT chunk_id FROM deletions WHERE seq > ? ORDER BY seq",
                                                (marks.deletion,)).fetchall()]
            rows = db.execute("SELECT id, embedding FROM chunks WHERE id > ? ORDER BY id", (marks.chunk_id,)).fetchall()
        return Changes(now, np.array(deleted, dtype=np.int64), *_vectors(rows, dim))

    # KV usage ----------------------------------------------------------------------------------
    def record_usage(self, served: Mapping[str, int], per_key: Mapping[str, tuple[int, int, float]]) -> None:
        """Add counts of retrieved chunks: per source (a store tier, or "computed"), and per kv key
        (hits, computes, last use in unix seconds). Keys in sorted order, so concurrent writers
        lock rows in the same order and never deadlock."""
        with self._write(serial=None) as db:
            db.executemany("INSERT INTO kv_served (source, chunks) VALUES (?, ?) ON CONFLICT (source)"
                           " DO UPDATE SET chunks = kv_served.chunks + excluded.chunks", sorted(served.items()))
            db.executemany(
                "INSERT INTO kv_usage (kv_key, hits, computes, last_used) VALUES (?, ?, ?, ?) ON CONFLICT (kv_key)"
                " DO UPDATE SET hits = kv_usage.hits + excluded.hits, computes = kv_usage.computes + excluded.computes,"
                " last_used = CASE WHEN excluded.last_used > kv_usage.last_used THEN excluded.last_used"
                " ELSE kv_usage.last_used END",
                [(key, *per_key[key]) for key in sorted(per_key)])

    def usage(self, top: int = 10) -> dict[str, Any]:
        """Retrieved chunks per source, and the `top` most hit KV entries (with a chunk that uses each)."""
        with self._snapshot() as db:
            served = {source: n for source, n in db.execute("SELECT source, chunks FROM kv_served ORDER BY source")}
            tracked = db.execute("SELECT COUNT(*) FROM kv_usage").fetchone()[0]
            rows = db.execute(
                "SELECT u.kv_key, u.hits, u.computes, u.last_used,"
                " (SELECT MIN(c.doc_id) FROM chunks c WHERE c.kv_key = u.kv_key)"
                " FROM kv_usage u ORDER BY u.hits DESC, u.last_used DESC, u.kv_key LIMIT ?", (top,)).fetchall()
        return {"served": served, "entries_used": tracked,
                "top": [{"kv_key": k, "hits": h, "computes": c, "last_used": t, "doc_id": d} for k, h, c, t, d in rows]}

    def kv_usage(self, kv_key: str) -> tuple[int, int, float] | None:
        """(hits, computes, last use) of one KV entry, None if never retrieved."""
        with self._read() as db:
            row = db.execute("SELECT hits, computes, last_used FROM kv_usage WHERE kv_key = ?", (kv_key,)).fetchone()
        return None if row is None else tuple(row)

    def referenced_keys(self, kv_keys: Collection[str]) -> set[str]:
        """Those of `kv_keys` some chunk uses (for `ragblend store gc`)."""
        keys, found = sorted(kv_keys), set()
        with self._read() as db:
            for i in range(0, len(keys), _ID_BATCH):
                batch = keys[i:i + _ID_BATCH]
                found |= {r[0] for r in db.execute(f"SELECT DISTINCT kv_key FROM chunks WHERE kv_key IN "
                                                   f"({','.join('?' * len(batch))})", batch)}
        return found

    # KV leases (store.leases.LeaseLedger) ------------------------------------------------------
    _LEASE_COLUMNS = "family, kv_key, tier, nbytes, ttl_s, soft, expires_at"
    _HELD = "SELECT DISTINCT kv_key, tier FROM kv_leases WHERE expires_at > ?"

    def grant_leases(self, family: str, sizes: Mapping[str, Mapping[str, int]], caps: Mapping[str, int],
                     ttl_s: float, soft: bool, now: float) -> dict[str, tuple[bool, int, int]]:
        """Lease every key of `sizes` (key -> tier -> its bytes there) to `family` until `now + ttl_s`, in
        each tier of `caps` whose running leases' bytes (each key once), with these keys added, stay within
        its cap; a tier they would pass is refused as a whole. Per tier: (granted, bytes pinned before, bytes
        this lease adds). A running lease of the family is extended, never shortened."""
        with self._write(serial=LEASES) as db:
            held: dict[str, dict[str, int]] = {}  # tier -> key -> bytes, of the running leases
            for tier, key, nbytes in db.execute("SELECT tier, kv_key, MAX(nbytes) FROM kv_leases WHERE expires_at > ?"
                                                " GROUP BY tier, kv_key", (now,)):
                held.setdefault(tier, {})[key] = nbytes
            outcome, rows = {}, []
            for tier, cap in caps.items():
                pinned = held.get(tier, {})
                before, adds = sum(pinned.values()), sum(s[tier] for key, s in sizes.items() if key not in pinned)
                outcome[tier] = (before + adds <= cap, before, adds)
                if outcome[tier][0]:
                    rows += [(family, key, tier, s[tier], ttl_s, soft, now + ttl_s) for key, s in sorted(sizes.items())]
            db.executemany(
                f"INSERT INTO kv_leases ({self._LEASE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (family, kv_key, tier) DO UPDATE SET nbytes = excluded.nbytes, ttl_s = excluded.ttl_s,"
                " soft = excluded.soft, expires_at = CASE WHEN excluded.expires_at > kv_leases.expires_at"
                " THEN excluded.expires_at ELSE kv_leases.expires_at END", rows)
        return outcome

    def renew_leases(self, hits: Mapping[str, float]) -> None:
        """Per kv key hit at a time: its soft leases that were running then run their ttl again from then."""
        with self._write(serial=LEASES) as db:
            db.executemany("UPDATE kv_leases SET expires_at = ? + ttl_s"
                           " WHERE kv_key = ? AND soft AND expires_at > ? AND ? + ttl_s > expires_at",
                           [(when, key, when, when) for key, when in sorted(hits.items())])

    def release_leases(self, family: str, now: float) -> list[tuple[str, str, bool]]:
        """End the family's leases. Per (kv key, tier) a running one held: whether another family's still does."""
        with self._write(serial=LEASES) as db:
            ended = db.execute("SELECT kv_key, tier FROM kv_leases WHERE family = ? AND expires_at > ?",
                               (family, now)).fetchall()
            db.execute("DELETE FROM kv_leases WHERE family = ?", (family,))
            return self._still_held(db, ended, now)

    def expire_leases(self, now: float) -> list[tuple[str, str, bool]]:
        """Delete the leases that ended by `now`. Per (kv key, tier) one held: whether another lease still does.
        A read first: the write lock is taken only when there is something to delete."""
        with self._read() as db:
            if db.execute("SELECT 1 FROM kv_leases WHERE expires_at <= ? LIMIT 1", (now,)).fetchone() is None:
                return []
        with self._write(serial=LEASES) as db:
            ended = db.execute("SELECT DISTINCT kv_key, tier FROM kv_leases WHERE expires_at <= ?", (now,)).fetchall()
            db.execute("DELETE FROM kv_leases WHERE expires_at <= ?", (now,))
            return self._still_held(db, ended, now)

    def _still_held(self, db: Connection, ended: Sequence[Sequence[Any]], now: float) -> list[tuple[str, str, bool]]:
        held = {(key, tier) for key, tier in db.execute(self._HELD, (now,))}
        return [(key, tier, (key, tier) in held) for key, tier in sorted({(k, t) for k, t in ended})]

    def active_leases(self, now: float) -> list[tuple[str, str, str, int, float, bool, float]]:
        """Every lease running at `now`: (family, kv key, tier, bytes, ttl_s, soft, expires_at)."""
        with self._read() as db:
            rows = db.execute(f"SELECT {self._LEASE_COLUMNS} FROM kv_leases WHERE expires_at > ?"
                              " ORDER BY family, kv_key, tier", (now,)).fetchall()
        return [(f, k, t, n, ttl, bool(soft), until) for f, k, t, n, ttl, soft, until in rows]
