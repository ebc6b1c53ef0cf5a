"""The service's lifecycle: the engine loaded in a background thread, the model thread and the ingest lane
started, health reported, and a graceful shutdown.

One engine owns the model; one scheduler thread runs all model work (app.serving.scheduler): up to
`server.max_batch` requests at a time, decoded together, their prefills interleaved layer by layer.
Uploads and deletes run one at a time on the ingest lane (app.serving.worker), which chunks and embeds off
the model thread and hands it only each chunk's KV precompute. Requests queue instead of racing: a
full queue answers 429, a request that waits past `server.request_timeout_s` answers 503, and a
client that disconnects (streaming or not) stops its work. app/components.py's `Serving` wires those
parts once the engine has loaded.

Health: /health reports the model thread (alive, what it runs and for how long, queue depth, active
slots, the longest wait for a first token) and the ingest lane; it says "degraded" (still 200) while a request
has waited past `server.degraded_wait_s` for its first token or a write found the data disk full, and is 503
while loading, after a failed load, while shutting down, or
when the model thread has been on one piece of work longer than `server.stuck_after_s`;
/health/live (503 only when the model thread is dead or stuck) and /health/ready (= /health's code)
for orchestrators. Shutdown (SIGTERM): stop accepting, cancel uploads (rolled back: nothing half
written), give running queries `server.shutdown_grace_s` to finish, then close the store and the
database — only once no thread is still using them.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from typing import Any, Callable, Iterator

import anyio
from tqdm import tqdm

from app.config import Settings
from app.engine.query import QueryParams, RequestError
from app.serving.metrics import Metrics
from app.serving.parts import Engine, Serving
from app.serving.scheduler import Scheduler
from app.serving.worker import Job, QueueFull, QueueTimeout, Worker, WorkerStopped
from app.tenants import current_tenant
from blend.grammar import Grammar, GrammarError
from common.housekeeping import Housekeeping
from common.threads import model_torch, serially

log = logging.getLogger("ragblend.server")

# Blocking work the event loop hands off, by pool: each a bound on anyio's worker threads (the ones Starlette runs
# sync routes, static files and form parsing on), never asyncio's default executor. "lookup": tokenizing, retrieval
# and store lookups (CPU: a few at once); "store": leases and other database writes (I/O); "grammar": requests'
# grammars, each waiting on a compile process (as many as limits.grammar_compile_workers).
POOLS = {"lookup": 2, "store": 4}
HOUSEKEEPING_POLL_S = 1.0  # the longest the loop waits before asking housekeeping again (tasks come as parts load)
DISK_FULL_S = 60.0  # /health says degraded this long after a write found the disk full
STOP_MARGIN_S = 10.0  # at shutdown, after the grace period: time for cancelled work to reach its next check


class Refused(Exception):
    """The service cannot take a request now: its HTTP status (429 or 503), a code, and when to retry."""

    def __init__(self, status: int, message: str, code: str, retry_after_s: int):
        super().__init__(message)
        self.status, self.code, self.retry_after_s = status, code, retry_after_s


class Service:
    """Owns the engine (given, or built by `build_engine` in a background thread), the parts wired around
    it (`serving`: None until loaded) and the ingest lane."""

    def __init__(self, settings: Settings, engine: Engine | None, build_engine: Callable[[Settings], Engine]):
        self.settings, self.engine, self.build_engine = settings, engine, build_engine
        self.owns_engine = engine is None
        self.serving: Serving | None = None
        self.lane = Worker(settings.server.queue_size, name="ragblend-ingest")
        self.embedding_use: dict[str, int] = {}  # tenant -> priced tokens of its embeddings requests in flight
        self.metrics = Metrics(lambda: self.waiting, lambda: self.running, self._store_stats,
                               lambda: self.scheduler.step_totals() if self.scheduler else {})
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.stopping: float | None = None  # when shutdown began (monotonic)
        self.created = int(time.time())
        self.disk_full_at: float | None = None  # when a write last found the data disk full (monotonic)
        self._pools: dict[str, anyio.CapacityLimiter] = {}  # made on the event loop, at first use
        self.housekeeping = Housekeeping(thread=False)  # the engine it builds hands it to its parts: `housekeep`

    def start(self) -> None:
        tqdm.monitor_interval = 0  # no tqdm monitor thread for the model's loading bar: a server has no terminal
        self.lane = Worker(self.settings.server.queue_size, name="ragblend-ingest")  # an app may be restarted
        self.housekeeping = Housekeeping(thread=False)  # (a stopped engine closed the last one)
        self.serving, self.stopping = None, None
        self.lane.start()
        if self.engine is not None:  # given a loaded engine (tests, benchmarks): ready at once
            return self._load()
        threading.Thread(target=self._load, name="ragblend-loader", daemon=True).start()

    def _load(self) -> None:
        model_torch()  # loading (and quantising) the model is the model's work
        try:
            engine = self.engine or self.build_engine(self.settings)
            serving = Serving(self.settings, engine, self.lane)
            serving.warm_up()
            self.engine, self.serving = engine, serving
            serving.scheduler.start()
            if self.settings.server.warm_up:
                self._warm_up(serving)
            if self.stopping is None:
                self.ready.set()
            log.info("engine ready", extra={"model": self.model_name, "max_batch": self.settings.server.max_batch})
        except Exception as exc:  # /health reports it; the process stays up to say why
            log.exception("engine failed to load")
            self.load_error = f"{type(exc).__name__}: {exc}"

    def _warm_up(self, serving: Serving) -> None:
        """Run `serving.warm_requests()` through the model thread, as requests (on a thread with its own event
        loop: this may be called from the app's), before ready. A failed one is logged and passed over: a
        server with no documents yet still warms the rest."""
        async def run_all() -> None:
            for params in serving.warm_requests():
                try:
                    job = serving.scheduler.submit(lambda p=params: serving.engine.request(p), label="warm-up",
                                                   output=serving.engine.output(params))
                    await job.wait_started(self.settings.server.request_timeout_s)  # (its output never sees STARTED)
                    await job.result()
                except WorkerStopped:  # shutting down before ready: nothing left to warm for
                    return
                except Exception as exc:
                    log.info("warm-up request failed", extra={"error": f"{type(exc).__name__}: {exc}"})

        start = time.monotonic()
        warm = threading.Thread(target=lambda: asyncio.run(run_all()), name="ragblend-warm-up")
        warm.start()
        warm.join()
        log.info("warmed up", extra={"s": round(time.monotonic() - start, 2)})

    @property
    def scheduler(self) -> Scheduler | None:
        return self.serving.scheduler if self.serving else None

    def begin_shutdown(self) -> None:
        """Stop accepting work and cancel uploads at once; running queries may finish within
        `server.shutdown_grace_s`, then they are cancelled too."""
        if self.stopping is not None:
            return
        self.stopping = time.monotonic()
        log.info("shutting down")
        self.ready.clear()
        self.lane.begin_stop()
        if self.scheduler is not None:
            self.scheduler.begin_stop()
            timer = threading.Timer(self.settings.server.shutdown_grace_s, self.scheduler.cancel_all)
            timer.name, timer.daemon = "ragblend-shutdown", True
            timer.start()

    def wait_drained(self, timeout_s: float) -> None:
        """Wait until no request or upload runs, `timeout_s` at most (after begin_shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self.running and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self) -> None:
        """Shut down: `begin_shutdown`, then wait for the lane and the model thread (the grace period, plus
        STOP_MARGIN_S for a chunk's precompute or an embedding batch to end) and close the store and the
        database — unless a thread still uses them."""
        self.begin_shutdown()
        deadline = self.stopping + self.settings.server.shutdown_grace_s + STOP_MARGIN_S
        clean = self.lane.stop(timeout=max(0.1, deadline - time.monotonic()))
        if self.scheduler is not None:
            left = max(0.0, self.stopping + self.settings.server.shutdown_grace_s - time.monotonic())
            clean = self.scheduler.stop(grace_s=left, timeout_s=max(0.1, deadline - time.monotonic())) and clean
        if self.owns_engine and self.serving is not None:
            if clean:
                self.serving.close()
            else:  # closing under a running thread could lose a write; the process is ending anyway
                log.warning("work still running at shutdown: store and database left to the process exit")
            self.engine = None
        log.info("stopped", extra={"clean": clean})

    @property
    def model_name(self) -> str:
        return self.serving.model_name if self.serving else "loading"

    @property
    def waiting(self) -> int:
        return self.lane.waiting + (self.scheduler.waiting if self.scheduler else 0)

    @property
    def running(self) -> int:
        return self.lane.running + (self.scheduler.active if self.scheduler else 0)

    def _store_stats(self) -> dict[str, Any] | None:
        return self.serving.store.stats() if self.ready.is_set() else None

    def health(self) -> dict[str, Any]:
        """The body of /health: status ok | loading | error | stuck | stopping, and the threads' state."""
        report: dict[str, Any] = {"status": "ok", "model": self.model_name}
        scheduler, problem = self.scheduler, None
        if self.load_error:
            report["status"], problem = "error", f"engine failed to load: {self.load_error}"
        elif self.stopping is not None:
            report["status"], problem = "stopping", "the server is shutting down"
        elif scheduler is None or not self.ready.is_set():
            report["status"], problem = "loading", "the model is loading" if scheduler is None else "warming up"
        elif not scheduler.snapshot()["alive"]:
            report["status"], problem = "error", "the model thread has died"
        elif scheduler.busy_s() > self.settings.server.stuck_after_s:
            report["status"] = "stuck"
            problem = (f"the model thread has been on one piece of work for {scheduler.busy_s():.0f} s "
                       f"(server.stuck_after_s: {self.settings.server.stuck_after_s:g})")
        if scheduler is not None:
            report["model_thread"] = scheduler.snapshot()
            degraded = self._degraded(report["model_thread"])
            if degraded and report["status"] == "ok":  # still answering (200), but slowly or in part
                report["status"], report["degraded"] = "degraded", degraded
        report["ingest"] = self.lane.snapshot()
        if self.serving and self.serving.blend_disabled:
            report["blend_disabled"] = self.serving.blend_disabled  # the model gate: every prefill runs in full
        if problem:
            report["error"] = {"message": problem, "type": "service_unavailable", "code": report["status"],
                               "param": None}
        return report

    def _degraded(self, model_thread: dict[str, Any]) -> list[str]:
        """Why the server answers worse than it should: requests waiting past server.degraded_wait_s for their
        first token; the data disk full (an upload or delete found no space in the last disk_full_s)."""
        reasons, bound = [], self.settings.server.degraded_wait_s
        if model_thread["oldest_wait_s"] > bound:
            reasons.append(f"a request has waited {model_thread['oldest_wait_s']:.0f} s for its first token "
                           f"(server.degraded_wait_s: {bound:g})")
        if self.disk_full_at is not None and time.monotonic() - self.disk_full_at < DISK_FULL_S:
            reasons.append("the data disk is full: uploads and deletes are refused (507)")
        return reasons

    def query_params(self, question: str, *, top_k: int | None, max_tokens: int | None, **rest: Any) -> QueryParams:
        """Engine parameters, with this server's defaults for what the request left out."""
        tenant = current_tenant().name
        return QueryParams(question, top_k=top_k or self.settings.retrieval.top_k,
                           max_tokens=max_tokens or self.settings.limits.default_max_new_tokens,
                           tenant=tenant, collection=self.settings.retrieval.collection(tenant), **rest)

    async def submit_query(self, params: QueryParams, kind: str) -> Job:
        """Queue a query for a slot on the model thread and wait until it has one, its grammar compiled first
        (`compile_grammar`). Its label, which /health shows to anyone, is its `kind` ("query", "chat"): never the
        client's text (that is logged at DEBUG)."""
        engine, scheduler = self.serving.engine, self.serving.scheduler
        if isinstance(params.grammar, str):
            params = replace(params, grammar=await self.compile_grammar(params.grammar))
        log.debug("request queued", extra={"kind": kind, "question": params.question[:200]})
        return await self._started(lambda: scheduler.submit(
            lambda: engine.request(params), label=kind, output=engine.output(params)), scheduler.retry_after)

    async def compile_grammar(self, grammar: str) -> Grammar:
        """A request's grammar, compiled before it takes a slot, so that the model thread never waits for one: a
        cached one (or a known failure) at once, else on the grammar threads within `limits.grammar_compile_s`
        (blend.grammar); one that fails is a 400 (RequestError)."""
        grammars = self.serving.engine.parts.grammars
        try:
            return grammars.cached(grammar) or await self.blocking("grammar", grammars.compile, grammar)
        except GrammarError as exc:
            raise RequestError(str(exc)) from None

    async def housekeep(self) -> None:
        """Run the periodic work (`housekeeping`: the usage flush, the lease sweep) from the event loop, each task on
        the "store" pool: a serving process keeps no thread for it. Runs until cancelled."""
        while True:
            wait = await self.blocking("store", self.housekeeping.run_due)
            await asyncio.sleep(HOUSEKEEPING_POLL_S if wait is None else min(wait, HOUSEKEEPING_POLL_S))

    async def blocking(self, pool: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` off the event loop, in `pool` (POOLS: at most that many at once)."""
        if (limiter := self._pools.get(pool)) is None:
            size = self.settings.limits.grammar_compile_workers if pool == "grammar" else POOLS[pool]
            limiter = self._pools[pool] = anyio.CapacityLimiter(size)
        return await anyio.to_thread.run_sync(partial(serially, fn, *args, **kwargs), limiter=limiter)

    def count_tokens(self, texts: list[str]) -> list[int]:
        """Each text's tokens in the model's tokenizer, special tokens left out: the unit of the budgets."""
        tokenizer = self.serving.tokenizer
        return [len(ids) for ids in tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]]

    def token_ids(self, prompt: str | list[int]) -> list[int]:
        """A raw prompt's token ids: a string tokenized as the tokenizer does by default; ids checked against the
        vocabulary (ValueError naming the first one past it)."""
        if isinstance(prompt, str):
            return self.serving.tokenizer(prompt)["input_ids"]
        if max(prompt) >= (vocab := self.serving.vocab):
            raise ValueError(f"token id {max(prompt)} is not in the vocabulary ({vocab})")
        return prompt

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each token's text on its own (logprobs)."""
        return self.serving.tokenizer.batch_decode([[t] for t in ids])

    async def lookup(self, params: QueryParams) -> Any:
        """What the request's prompt would read from the store, looked up off the loop (engine.lookup: a Plan)."""
        return await self.blocking("lookup", self.serving.engine.lookup, params)

    async def start_on_lane(self, fn: Callable[[Callable[[], bool]], Any], label: str, yields: bool = False) -> Job:
        """Queue `fn(cancelled)` on the ingest lane (behind uploads and deletes if it `yields`) and wait until it
        starts (its result: `job.result()`)."""
        return await self._started(lambda: self.lane.submit(lambda cancelled: [fn(cancelled)], label, yields),
                                   self.lane.retry_after)

    @contextmanager
    def embedding_share(self, price: int) -> Iterator[None]:
        """Hold `price` of the request's tenant's embeddings budget (limits.max_tenant_embedding_tokens) while it
        runs or waits; a 429 when its requests in flight already hold too much."""
        tenant, cap = current_tenant().name, self.settings.limits.max_tenant_embedding_tokens
        held = self.embedding_use.get(tenant, 0)
        if held + price > cap:
            raise Refused(429, f"this key's embeddings requests in flight are priced at {held} tokens; {price} more "
                               f"is over limits.max_tenant_embedding_tokens ({cap}): retry once they end",
                          "embedding_budget", self.lane.retry_after())
        self.embedding_use[tenant] = held + price
        try:
            yield
        finally:
            self.embedding_use[tenant] -= price

    async def _started(self, submit: Callable[[], Job], retry_after: Callable[[], int]) -> Job:
        """Queue a job and wait until it starts (429 when full, 503 after the timeout or when stopping; each
        with a Retry-After)."""
        try:
            job = submit()
        except QueueFull:
            raise Refused(429, "too many requests waiting; retry later", "queue_full", retry_after()) from None
        try:
            await job.wait_started(self.settings.server.request_timeout_s)
        except QueueTimeout:
            raise Refused(503, "timed out waiting in the queue; retry later", "queue_timeout", retry_after()) from None
        except asyncio.CancelledError:
            job.cancel()
            raise
        self.metrics.observe_queue(job.queue_s)
        return job
