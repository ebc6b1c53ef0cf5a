"""The metadata backends by URL: the one module that knows them all (retrieval.metadata is their base,
retrieval.sqlite and retrieval.postgres its implementations; none of them imports this one)."""
from __future__ import annotations

from pathlib import Path

from retrieval.metadata import DB_FILE, Metadata
from retrieval.sqlite import SQLiteMetadata


def open_metadata(database_url: str | None, index_dir: Path) -> Metadata:
    """The metadata a URL names: None (SQLite under `index_dir`), sqlite:///path, or postgresql://..."""
    if database_url is None:
        return SQLiteMetadata(Path(index_dir) / DB_FILE)
    if database_url.startswith("sqlite:///"):
        return SQLiteMetadata(Path(database_url.removeprefix("sqlite:///")))
    if database_url.startswith(("postgresql://", "postgres://")):
        from retrieval.postgres import PostgresMetadata  # psycopg only when PostgreSQL is asked for

        return PostgresMetadata(database_url)
    raise ValueError(f"unsupported database URL {database_url.split(':')[0]}://...: use sqlite:///PATH or "
                     f"postgresql://USER:PASSWORD@HOST:PORT/DB")
