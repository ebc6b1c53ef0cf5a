"""The one place that builds ragblend's parts from Settings: server, CLI, ingest, compare and bench.

`Components`: each part is built on first use and kept, so a command pays only for what it touches
(`ragblend store stats` opens the store without loading the LLM). `close()` closes what was built.
What the HTTP service adds once its engine has loaded is app/serving/parts.py's `Serving`.
"""
from __future__ import annotations

from functools import cached_property

from app.cachegen import tier_codecs
from app.config import Settings
from app.engine.ingest import Ingestor
from app.engine.kv import ChunkKVCache
from app.engine.loading import LoadingControl
from app.engine.usage import UsageLog
from blend import Blender, DecodeRuntime, LoadedModel, PromptFormat, load_model
from blend.cache import RoundTrip
from blend.grammar import Grammars
from common.housekeeping import Housekeeping
from retrieval import Chunker, Embedder, Metadata, Retriever, open_embedder, open_metadata
from store import TieredStore, build_store
from store.codecs import Codec


class Components:
    def __init__(self, settings: Settings, housekeeping: Housekeeping | None = None):
        """`housekeeping`: who runs periodic work (the server's, run from its event loop); None: its own thread."""
        if housekeeping is not None:
            self.housekeeping = housekeeping
        self.settings = settings

    @cached_property
    def llm(self) -> LoadedModel:
        m = self.settings.model
        return load_model(m.name, cache_dir=self.settings.model_cache_dir, dtype=m.dtype, device=m.device,
                          weights=m.weights)

    @property
    def tokenizer(self):
        return self.llm.tokenizer

    @cached_property
    def blender(self) -> Blender:
        """The Blender for the blend settings; a check layer the model cannot have is a config error."""
        b, m = self.settings.blend, self.settings.model
        try:
            return Blender(self.llm.model, self.llm.tokenizer, self.llm.fingerprint, check_layer=b.check_layer,
                           deviation=b.deviation, selection=b.selection, cpu_kernel=m.cpu_kernel,
                           chunk_tokens=self.settings.server.prefill_chunk_tokens)
        except ValueError as exc:
            raise ValueError(f"invalid blend settings: {exc}") from None

    @cached_property
    def runtime(self) -> DecodeRuntime:
        """Decoding: the KV pool, one slot per request the scheduler runs at once (app.serving.scheduler), and the
        step."""
        m = self.settings.model
        return DecodeRuntime(self.blender, slots=self.settings.server.max_batch, max_len=m.kv_pool_tokens,
                             cuda_graphs=m.cuda_graphs)

    @cached_property
    def grammars(self) -> Grammars:
        """Compiles the answers' grammars (tool_choice, response_format), each bounded in time (blend.grammar)."""
        limits = self.settings.limits
        return Grammars(self.llm.tokenizer, self.runtime.vocab, limit_s=limits.grammar_compile_s,
                        workers=limits.grammar_compile_workers)

    @cached_property
    def prompt(self) -> PromptFormat:
        return PromptFormat(self.llm.tokenizer, self.settings.model.system_prompt)

    @cached_property
    def store(self) -> TieredStore:
        """The store, its leases kept in the metadata database (shared by replicas, kept across restarts)."""
        return build_store(self.settings.store, self.settings.kv_dir, self.llm.fingerprint,
                           self.blender.backend.placement,  # the gpu tier and pinned memory follow the model
                           ledger=self.metadata, codecs=self.codecs, housekeeping=self.housekeeping,
                           tenant_shares=self.settings.server.tenant_shares())

    @cached_property
    def stored_round_trip(self) -> RoundTrip | None:
        """How a span the store keeps reads back from its fastest tier (the form a repeat of the prompt gets), a
        layer at a time, for the prefill that computes it to attend to (blend.cache.StoredSpans); None where that
        is the KV itself (native) or the codec cannot code a layer alone (cachegen)."""
        codec = self.codecs[self.store.tiers[0].name] if self.store.tiers else None
        return codec.round_trip_spans if codec is not None and codec.layerwise and codec.name != "native" else None

    @cached_property
    def codecs(self) -> dict[str, Codec]:
        """Each store tier's codec, cachegen's with this model's tables (app/cachegen.py: shared or fitted)."""
        return tier_codecs(self.settings.store, self.settings.kv_dir, self.blender, self.prompt)

    def inspect_store(self) -> TieredStore:
        """The store opened without a model, for stats only (the caller closes it)."""
        return build_store(self.settings.store, self.settings.kv_dir, fingerprint=None, ledger=self.metadata)

    def owned_keys(self, keys: list[str]) -> set[str]:
        """Those of `keys` the collection owns (documents' chunks) or the prompt head is: what `ragblend store
        gc` keeps, and what dropping a lease family leaves in the store."""
        return self.metadata.referenced_keys(keys) | ({self.kv_cache.head_key} & set(keys))

    @cached_property
    def kv_cache(self) -> ChunkKVCache:
        return ChunkKVCache(self.blender, self.prompt, self.store, precompute=self.settings.blend.precompute,
                            on_served=self.usage.record)

    @cached_property
    def loading(self) -> LoadingControl:
        """The loading controller's glue (blend.ratio: auto), learning from this process's prefills."""
        return LoadingControl(self.blender, self.store, self.settings.blend.ratio_floor)

    @cached_property
    def metadata(self) -> Metadata:
        """Documents, chunks, the change log and KV usage: SQLite in the index dir, or the shared database."""
        return open_metadata(self.settings.retrieval.database_url, self.settings.index_dir)

    @cached_property
    def usage(self) -> UsageLog:
        # store_counts: the store's dropped entries
        return UsageLog(self.metadata, self.housekeeping, store_counts=lambda: self.store.counts())

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

    @cached_property
    def housekeeping(self) -> Housekeeping:
        """The one thread for periodic work: the usage flush, the store's lease sweep."""
        return Housekeeping()

    def close(self) -> None:
        """Write the last usage counts, close the store and the metadata database, stop the grammar compile
        processes, if they were opened, then stop housekeeping."""
        for name in ("usage", "store", "retriever", "metadata", "grammars", "housekeeping"):
            part = self.__dict__.pop(name, None)
            if part is not None:
                part.close()
