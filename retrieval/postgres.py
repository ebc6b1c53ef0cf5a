"""Metadata in PostgreSQL, shared by every replica (psycopg 3 with its connection pool).

Writers that add or remove chunks take one transaction-scoped advisory lock first, so they commit
one after another and identity ids grow in commit order (the contract in retrieval/metadata.py);
lease changes take another, so a tier's pinned bytes are summed and added to by one writer at a time.
A writer that dies mid-transaction (SIGKILL, lost connection) is rolled back by the server, and
its lock goes with its session.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import ConnectionPool, PoolTimeout

from retrieval.metadata import CHUNKS, LEASES, Metadata


def _advisory_lock(name: bytes) -> int:
    """A fixed 63-bit advisory lock number derived from a name."""
    return int.from_bytes(hashlib.sha256(name).digest()[:8], "big") >> 1


# The advisory lock each kind of serialized writer shares (`Metadata._write`'s `serial`).
LOCKS = {CHUNKS: _advisory_lock(b"ragblend.metadata.write"), LEASES: _advisory_lock(b"ragblend.metadata.leases")}
POOL_SIZE = 5  # the worker, the usage flusher, the lease sweeper, HTTP reads: rarely more at once
CONNECT_TIMEOUT_S = 10.0

_V1 = (
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE documents (
        id TEXT PRIMARY KEY,
        title TEXT,
        source TEXT,
        content_hash TEXT NOT NULL,
        n_chunks INTEGER NOT NULL,
        ingested_at DOUBLE PRECISION NOT NULL
    )""",
    """CREATE TABLE chunks (
        id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        doc_id TEXT NOT NULL REFERENCES documents(id) ON DELETE CASCADE,
        ordinal INTEGER NOT NULL,
        text TEXT NOT NULL,
        token_ids BYTEA NOT NULL,
        n_tokens INTEGER NOT NULL,
        content_hash TEXT NOT NULL,
        kv_key TEXT,
        start_char INTEGER NOT NULL,
        end_char INTEGER NOT NULL,
        embedding BYTEA NOT NULL,
        UNIQUE (doc_id, ordinal)
    )""",
    "CREATE INDEX chunks_kv_key ON chunks (kv_key)",
)
_V2 = (
    "CREATE TABLE deletions (seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, chunk_id BIGINT NOT NULL)",
    "CREATE TABLE kv_served (source TEXT PRIMARY KEY, chunks BIGINT NOT NULL)",
    """CREATE TABLE kv_usage (
        kv_key TEXT PRIMARY KEY,
        hits BIGINT NOT NULL,
        computes BIGINT NOT NULL,
        last_used DOUBLE PRECISION NOT NULL
    )""",
)
_V3 = (
    """CREATE TABLE kv_leases (
        family TEXT NOT NULL,
        kv_key TEXT NOT NULL,
        tier TEXT NOT NULL,
        nbytes BIGINT NOT NULL,
        ttl_s DOUBLE PRECISION NOT NULL,
        soft BOOLEAN NOT NULL,
        expires_at DOUBLE PRECISION NOT NULL,
        PRIMARY KEY (family, kv_key, tier)
    )""",
    "CREATE INDEX kv_leases_key ON kv_leases (kv_key)",
    "CREATE INDEX kv_leases_expiry ON kv_leases (expires_at)",
)
# Version 4: documents per tenant (`retrieval.documents: tenant`): a document is (tenant, id), "" the shared
# collection every older row joins.
_V4 = (
    "ALTER TABLE chunks DROP CONSTRAINT chunks_doc_id_fkey",
    "ALTER TABLE chunks DROP CONSTRAINT chunks_doc_id_ordinal_key",
    "ALTER TABLE documents ADD COLUMN tenant TEXT NOT NULL DEFAULT ''",
    "ALTER TABLE documents DROP CONSTRAINT documents_pkey",
    "ALTER TABLE documents ADD PRIMARY KEY (tenant, id)",
    "ALTER TABLE chunks ADD COLUMN tenant TEXT NOT NULL DEFAULT ''",
    "ALTER TABLE chunks ADD UNIQUE (tenant, doc_id, ordinal)",
    "ALTER TABLE chunks ADD FOREIGN KEY (tenant, doc_id) REFERENCES documents (tenant, id) ON DELETE CASCADE",
)


class _Connection:
    """A psycopg connection that speaks the shared queries' `?` placeholders."""

    def __init__(self, conn: psycopg.Connection) -> None:
        self.conn = conn

    def execute(self, sql: str, params: Sequence[Any] = ()) -> psycopg.Cursor:
        return self.conn.execute(sql.replace("?", "%s"), params)

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        with self.conn.cursor() as cursor:
            cursor.executemany(sql.replace("?", "%s"), list(rows))


def describe(url: str) -> str:
    """user@host:port/db of a connection URL, without its password."""
    try:
        p = conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "postgresql://(unparsable URL)"
    return f"postgresql://{p.get('user', '')}@{p.get('host', 'localhost')}:{p.get('port', 5432)}/{p.get('dbname', '')}"


class PostgresMetadata(Metadata):
    backend = "postgresql"
    MIGRATIONS = (_V1, _V2, _V3, _V4)

    def __init__(self, url: str, pool_size: int = POOL_SIZE) -> None:
        self._where = describe(url)
        # Autocommit connections: a lone read is one round trip; transactions are explicit.
        # `check` replaces connections that died (a database restart) before handing them out.
        self.pool = ConnectionPool(url, min_size=1, max_size=pool_size, kwargs={"autocommit": True},
                                   check=ConnectionPool.check_connection, timeout=CONNECT_TIMEOUT_S,
                                   name="ragblend-metadata", open=False)
        try:
            self.pool.open(wait=True, timeout=CONNECT_TIMEOUT_S)
        except PoolTimeout:
            self.pool.close()
            raise ConnectionError(f"cannot connect to {self._where} within {CONNECT_TIMEOUT_S:.0f}s: "
                                  f"is PostgreSQL running and the URL right?") from None
        self._migrate()

    def where(self) -> str:
        return self._where

    def close(self) -> None:
        self.pool.close()

    @contextmanager
    def _read(self) -> Iterator[_Connection]:
        with self.pool.connection() as conn:
            yield _Connection(conn)

    @contextmanager
    def _snapshot(self) -> Iterator[_Connection]:
        with self.pool.connection() as conn, conn.transaction():
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            yield _Connection(conn)

    @contextmanager
    def _write(self, serial: str | None = CHUNKS) -> Iterator[_Connection]:
        with self.pool.connection() as conn, conn.transaction():
            if serial is not None:
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (LOCKS[serial],))
            yield _Connection(conn)
