"""The one place that builds ragblend's parts from Settings: server, CLI, ingest, compare and bench.

Each part is built on first use and kept, so a command pays only for what it touches
(`ragblend store stats` opens the store without loading the LLM). `close()` closes what was built.
"""
from __future__ import annotations

from functools import cached_property

from app.config import Settings
from app.ingest import Ingestor
from app.kv import ChunkKVCache
from app.usage import UsageLog
from blend import Blender, LoadedModel, PromptFormat, load_model
from retrieval import Chunker, Embedder, Metadata, Retriever, open_embedder, open_metadata
from store import TieredStore, build_store


class Components:
    def __init__(self, settings: Settings):
        self.settings = settings

    @cached_property
    def llm(self) -> LoadedModel:
        m = self.settings.model
        return load_model(m.name, cache_dir=self.settings.model_cache_dir, dtype=m.dtype, device=m.device)

    @property
    def tokenizer(self):
        return self.llm.tokenizer

    @cached_property
    def blender(self) -> Blender:
        """The Blender for the blend settings; a check layer the model cannot have is a config error."""
        b = self.settings.blend
        try:
            return Blender(self.llm.model, self.llm.tokenizer, self.llm.fingerprint, check_layer=b.check_layer,
                           deviation=b.deviation, selection=b.selection)
        except ValueError as exc:
            raise ValueError(f"invalid blend settings: {exc}") from None

    @cached_property
    def prompt(self) -> PromptFormat:
        return PromptFormat(self.llm.tokenizer, self.settings.model.system_prompt)

    @cached_property
    def store(self) -> TieredStore:
        return build_store(self.settings.store, self.settings.kv_dir, self.llm.fingerprint,
                           device=self.blender.device)  # gpu_bytes "auto" and pinned memory follow the model

    def inspect_store(self) -> TieredStore:
        """The store opened without a model, for stats only (the caller closes it)."""
        return build_store(self.settings.store, self.settings.kv_dir, fingerprint=None)

    @cached_property
    def kv_cache(self) -> ChunkKVCache:
        return ChunkKVCache(self.blender, self.prompt, self.store, precompute=self.settings.blend.precompute,
                            on_served=self.usage.record)

    @cached_property
    def metadata(self) -> Metadata:
        """Documents, chunks, the change log and KV usage: SQLite in the index dir, or the shared database."""
        return open_metadata(self.settings.retrieval.database_url, self.settings.index_dir)

    @cached_property
    def usage(self) -> UsageLog:
        return UsageLog(self.metadata)

    @cached_property
    def embedder(self) -> Embedder:
        return open_embedder(self.settings.embedder)

    @cached_property
    def retriever(self) -> Retriever:
        r = self.settings.retrieval
        return Retriever(self.settings.index_dir, self.embedder, kind=r.index, order=r.order, top_k=r.top_k,
                         metadata=self.metadata)

    @cached_property
    def chunker(self) -> Chunker:
        return Chunker(self.llm.tokenizer, self.settings.chunking)

    @cached_property
    def ingestor(self) -> Ingestor:
        return Ingestor(self.retriever, self.chunker, self.kv_cache,
                        max_chars=self.settings.limits.max_document_chars,
                        precompute_at=self.settings.blend.precompute_at)

    def close(self) -> None:
        """Write the last usage counts, close the store and the metadata database, if they were opened."""
        for name in ("usage", "store", "retriever", "metadata"):
            part = self.__dict__.pop(name, None)
            if part is not None:
                part.close()
