"""The one place that builds ragblend's parts from Settings: server, CLI, ingest, compare and bench.

`Components`: each part is built on first use and kept, so a command pays only for what it touches
(`ragblend store stats` opens the store without loading the LLM). `close()` closes what was built.
`Serving`: what the HTTP service adds once its engine has loaded — the model thread that runs all
model work, and the upload Ingestor, which chunks and embeds on the ingest lane and precomputes each
chunk's KV on the model thread. The routes receive these parts; nothing else reaches into them.
"""
from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Generator, Sequence
from dataclasses import replace
from functools import cached_property
from typing import Any, Protocol

from app.cachegen import tier_codecs
from app.config import Settings
from app.ingest import IngestCancelled, Ingestor
from app.kv import ChunkKVCache
from app.loading import LoadingControl
from app.scheduler import Scheduler
from app.usage import UsageLog
from app.worker import Worker
from blend import Blender, DecodeRuntime, LoadedModel, PromptFormat, load_model
from blend.cache import RoundTrip
from retrieval import Chunker, Embedder, Metadata, Retriever, open_embedder, open_metadata
from store import TieredStore, build_store
from store.codecs import Codec


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
        b, m = self.settings.blend, self.settings.model
        try:
            return Blender(self.llm.model, self.llm.tokenizer, self.llm.fingerprint, check_layer=b.check_layer,
                           deviation=b.deviation, selection=b.selection, cpu_kernel=m.cpu_kernel,
                           chunk_tokens=self.settings.server.prefill_chunk_tokens)
        except ValueError as exc:
            raise ValueError(f"invalid blend settings: {exc}") from None

    @cached_property
    def runtime(self) -> DecodeRuntime:
        """Decoding: the KV pool, one slot per request the scheduler runs at once (app.scheduler), and the step."""
        m = self.settings.model
        return DecodeRuntime(self.blender, slots=self.settings.server.max_batch, max_len=m.kv_pool_tokens,
                             cuda_graphs=m.cuda_graphs)

    @cached_property
    def prompt(self) -> PromptFormat:
        return PromptFormat(self.llm.tokenizer, self.settings.model.system_prompt)

    @cached_property
    def store(self) -> TieredStore:
        """The store, its leases kept in the metadata database (shared by replicas, kept across restarts)."""
        return build_store(self.settings.store, self.settings.kv_dir, self.llm.fingerprint,
                           self.blender.backend.placement,  # the gpu tier and pinned memory follow the model
                           ledger=self.metadata, codecs=self.codecs)

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
        return UsageLog(self.metadata, store_counts=lambda: self.store.counts())  # the store's dropped entries

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


# ---- the HTTP service's wiring ---------------------------------------------------------------------

class Engine(Protocol):
    """What the service runs queries on: app.engine.RagEngine (or a stand-in with the same parts)."""

    parts: Components

    def program(self, params: Any, cancelled: Callable[[], bool]) -> Generator[Any, Any, None]: ...


class Serving:
    """The service's parts once `engine` has loaded: its model thread (`scheduler`, not yet started), the
    upload Ingestor (`uploads`), and what the routes read (`retriever`, `store`, `model_name`,
    `blend_disabled`)."""

    def __init__(self, settings: Settings, engine: Engine, lane: Worker):
        parts, s = engine.parts, settings.server
        self.engine, self._parts, self._lane, self._limits = engine, parts, lane, settings.limits
        self.scheduler = Scheduler(parts.runtime.step, max_batch=s.max_batch, queue_size=s.queue_size,
                                   slice_s=s.prefill_slice_ms / 1000, max_stall_s=s.max_stall_ms / 1000)
        self.model_name = parts.llm.name
        self.blend_disabled: str | None = getattr(parts.blender, "unsupported", None)  # the model gate's reason

    @property
    def retriever(self) -> Retriever:
        return self._parts.retriever  # built on first use, as ever: a missing index fails a request, not the load

    @property
    def store(self) -> TieredStore:
        return self._parts.store

    def owned_keys(self, keys: list[str]) -> set[str]:
        return self._parts.owned_keys(keys)

    @cached_property
    def uploads(self) -> Ingestor:
        """The parts' Ingestor as the ingest lane runs it: this server's document limit, its KV precompute
        on the model thread, and stopped (IngestCancelled, nothing committed) between two embedding
        batches or chunks once the lane's running job is cancelled (its client left, or the server stops)."""
        def check(_: int = 0) -> None:
            if self._lane.cancelled():
                raise IngestCancelled("upload cancelled")

        kv = ModelThreadKV(self._parts.kv_cache, self.scheduler, self._lane.cancelled)
        return replace(self._parts.ingestor, kv_cache=kv, on_embedded=check,
                       max_chars=self._limits.max_document_chars)

    def warm_up(self) -> None:
        """First calls before any concurrency: the prompt head's KV and one embedding (the embedder's tokenizer
        sets its padding/truncation state on first use; later calls from two threads only read it). (The decode
        runtime, with the kernel step's probe, was built with the scheduler.)"""
        parts = self._parts
        for warm in (lambda: parts.kv_cache.head(), lambda: parts.embedder.embed(["warm up"])):
            try:
                warm()
            except AttributeError:  # a stand-in engine without these parts
                pass

    def close(self) -> None:
        """Close the engine's store and database (once no thread uses them)."""
        self._parts.close()


class ModelThreadKV:
    """The chunk KV cache as the ingest lane uses it: store reads here, each precompute on the model thread."""

    def __init__(self, kv: ChunkKVCache, scheduler: Scheduler, cancelled: Callable[[], bool]):
        self.kv, self.scheduler, self.cancelled = kv, scheduler, cancelled

    def passage_ids(self, chunk_ids: Sequence[int], title: str | None = None) -> list[int]:
        return self.kv.passage_ids(chunk_ids, title)

    def key(self, ids: Sequence[int], collection: str = "") -> str:
        return self.kv.key(ids, collection)

    def delete(self, key: str) -> None:
        self.kv.delete(key)

    def ensure(self, ids: Sequence[int], collection: str = "") -> str:
        if self.kv.store.contains(key := self.kv.key(ids, collection)):
            return key
        try:
            return self.scheduler.run_on_model(lambda: self.kv.ensure(ids, collection),
                                               label="upload: chunk KV precompute",
                                               cancelled=self.cancelled)
        except concurrent.futures.CancelledError:
            raise IngestCancelled("upload cancelled") from None
