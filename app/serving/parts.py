"""What the HTTP service adds once its engine has loaded: the model thread that runs all model work (the
`Scheduler`) and the upload Ingestor, which chunks and embeds on the ingest lane and precomputes each chunk's KV on
the model thread. The routes receive these parts; nothing else reaches into them."""
from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import cached_property
from typing import Any, Protocol

from app.components import Components
from app.config import Settings
from app.engine.ingest import IngestCancelled, Ingestor
from app.engine.kv import ChunkKVCache
from app.engine.query import QueryParams
from app.engine.tool_calls import tools_grammar
from app.serving.scheduler import Scheduler
from app.serving.worker import Worker
from blend.driver import Output, Work
from retrieval import Embedder, Retriever
from store import TieredStore

WARM_TENANT = "ragblend:warm-up"  # the warm-up requests' tenant: their store keys mix it in
WARM_TOKENS = 2
# A passage of a few hundred tokens: the planner's cost rates (planner.by_cost) are fixed from these prefills, and a
# prompt of a few dozen tokens would price every token-layer by the layers' fixed costs.
WARM_PASSAGE = (
    "The lighthouse at the harbour mouth was built of granite in the last century and has guided fishing boats "
    "home through fog and storms ever since. Its keeper lives in the cottage beside the tower, with a garden of "
    "potatoes and a goat that eats the washing. Every evening at dusk the keeper climbs one hundred and twelve "
    "steps to trim the wick, wind the clockwork that turns the lens, and write the weather in the log book.\n\n"
    "The harbour itself is older than the town. Its first quay was laid by monks who traded wool for salt and "
    "wine, and the stones they cut still hold the iron rings where their boats were moored. In the great storm "
    "of the winter the sea broke over the quay, carried away the fish market and left a whale on the slipway, "
    "which the children of the town remember to this day.\n\n"
    "Today the boats bring in mackerel in summer and crab in autumn. The market opens at five in the morning, "
    "the auction is over by seven, and the cafe on the corner sells fried fish to the tourists who come on the "
    "afternoon ferry from the island, where the old fort has become a museum of the coast and its wrecks.")
WARM_CHAT = (("system", "Answer briefly."),
             ("user", WARM_PASSAGE),
             ("assistant", "Noted."),
             ("user", "What is the lighthouse built of?"))
# the passage again behind another opening: found by its content, not as the exact prefix, so it is blended
WARM_BLEND = (WARM_CHAT[0], ("user", "Read this first.\n\n" + WARM_PASSAGE), *WARM_CHAT[2:])


def _messages(turns: tuple[tuple[str, str], ...]) -> tuple[dict, ...]:
    return tuple({"role": role, "content": text} for role, text in turns)


class Engine(Protocol):
    """What the service runs queries on: app.engine.rag_engine.RagEngine (or a stand-in with the same parts)."""

    parts: Components

    def request(self, params: Any) -> Work: ...

    def output(self, params: Any) -> Output: ...

    def lookup(self, params: Any) -> Any: ...


class Serving:
    """The service's parts once `engine` has loaded: its model thread (`scheduler`, not yet started), the
    upload Ingestor (`uploads`), and what the routes read (`retriever`, `store`, `tokenizer`, `vocab`, `embedder`,
    `model_name`, `blend_disabled`)."""

    def __init__(self, settings: Settings, engine: Engine, lane: Worker):
        parts, s = engine.parts, settings.server
        self.engine, self._parts, self._lane, self._limits = engine, parts, lane, settings.limits
        self.scheduler = Scheduler(parts.runtime.advance, layers=parts.blender.num_layers, max_batch=s.max_batch,
                                   queue_size=s.queue_size, step_token_budget=s.step_token_budget)
        self.model_name = parts.llm.name
        self.blend_disabled: str | None = getattr(parts.blender, "unsupported", None)  # the model gate's reason

    @property
    def retriever(self) -> Retriever:
        return self._parts.retriever  # built on first use, as ever: a missing index fails a request, not the load

    @property
    def store(self) -> TieredStore:
        return self._parts.store

    @property
    def tokenizer(self) -> Any:
        return self._parts.tokenizer

    @property
    def vocab(self) -> int:
        """The model's vocabulary: token ids at or past it are none of its."""
        return self._parts.runtime.vocab

    @property
    def embedder(self) -> Embedder:
        return self._parts.embedder

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
        """First calls before any concurrency: the prompt head's KV, one embedding (the embedder's tokenizer
        sets its padding/truncation state on first use; later calls from two threads only read it) and the grammar
        compiler (the tokenizer's llguidance form, its compile processes). (The decode runtime, with the kernel
        step's probe, was built with the scheduler.)"""
        parts = self._parts
        for warm in (lambda: parts.kv_cache.head(), lambda: parts.embedder.embed(["warm up"]),
                     lambda: parts.grammars.start()):
            try:
                warm()
            except AttributeError:  # a stand-in engine without these parts
                pass

    def warm_requests(self) -> list[QueryParams]:
        """The requests the service runs through the model thread before it says ready (server.warm_up), so the
        paths a first request takes have run once: retrieval (the index loaded), the planner, a prefill, a chat
        whose spans the next one blends (a blended prefill), decode steps and the grammar path. Their KV is
        stored under a tenant of their own, never a client's."""
        chat, again = _messages(WARM_CHAT), _messages(WARM_BLEND)
        ask = dict(max_tokens=WARM_TOKENS, tenant=WARM_TENANT)
        return [QueryParams(WARM_CHAT[-1][1], **ask),  # retrieval over the documents (the default collection)
                QueryParams(WARM_CHAT[-1][1], messages=chat, retrieve=False, **ask),  # computed
                # blended: the planner's rates settle on these two prefills (app.engine.loading.planning_rates)
                QueryParams(WARM_CHAT[-1][1], messages=again, retrieve=False, **ask),
                QueryParams(WARM_CHAT[-1][1], messages=chat, retrieve=False, grammar=tools_grammar(
                    [], None, answer_schema={"type": "object"}), **ask)]  # a grammar compiled and applied

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
        """ChunkKVCache.ensure with its compute on the model thread (the store checked here, once)."""
        if self.kv.store.contains(key := self.kv.key(ids, collection)):
            return key
        try:
            return self.scheduler.run_on_model(lambda: self.kv.compute_put(ids, collection),
                                               label="upload: chunk KV precompute", cost=len(ids),
                                               cancelled=self.cancelled)
        except concurrent.futures.CancelledError:
            raise IngestCancelled("upload cancelled") from None
