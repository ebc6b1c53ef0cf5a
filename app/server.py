"""The HTTP API: ragblend's own query and document endpoints, and OpenAI-compatible chat completions.

One engine owns the model; one scheduler thread runs all model work (app.scheduler): up to
`server.max_batch` requests at a time, decoded together, their prefills interleaved layer by layer.
Uploads and deletes run one at a time on the ingest lane (app.worker), which chunks and embeds off
the model thread and hands it only each chunk's KV precompute. Requests queue instead of racing: a
full queue answers 429, a request that waits past `server.request_timeout_s` answers 503, and a
client that disconnects (streaming or not) stops its work. The engine loads in a background thread.

Health: /health reports the model thread (alive, what it runs and for how long, queue depth, active
slots) and the ingest lane, and is 503 while loading, after a failed load, while shutting down, or
when the model thread has been on one piece of work longer than `server.stuck_after_s`;
/health/live (503 only when the model thread is dead or stuck) and /health/ready (= /health's code)
for orchestrators. Shutdown (SIGTERM): stop accepting, cancel uploads (rolled back: nothing half
written), give running queries `server.shutdown_grace_s` to finish, then close the store and the
database — only once no thread is still using them.

Every error body is OpenAI-shaped: {"error": {"message", "type", "code", "param"}}.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import logging
import signal
import tempfile
import threading
import time
import uuid
from contextlib import asynccontextmanager, contextmanager
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.datastructures import UploadFile

from app.api_models import (ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, ChatMessageOut, Choice,
                            ChunkChoice, DeletedDocument, Delta, DocumentIn, DocumentList, DocumentMeta,
                            ErrorResponse, IngestedDocument, IngestResponse, LimitError, ModelCard, ModelList,
                            PromptTokensDetails, QueryRequest, QueryResponse, Usage, check_limits, openapi_body)
from app.config import Settings
from app.conversation import Conversation
from app.engine import QueryParams, QueryResult, RagEngine
from app.errors import HANDLED, ApiError, as_api_error, handle_error
from app.ingest import SUFFIXES, IngestCancelled, Ingestor, SourceDocument, read_documents
from app.metrics import Metrics
from app.middleware import HEALTH_PATHS, CountRequests, LimitBody, RequireApiKey
from app.page import PUBLIC_PATHS, PUBLIC_PREFIX, page_routes
from app.scheduler import Scheduler
from app.worker import Job, QueueFull, Worker, WorkerStopped
from retrieval import DocumentInfo

log = logging.getLogger("ragblend.server")

STOP_MARGIN_S = 10.0  # at shutdown, after the grace period: time for cancelled work to reach its next check


# ---- the service: engine, scheduler, ingest lane, metrics --------------------------------------

class Service:
    """Owns the engine (loaded in a background thread), the scheduler that runs all its model work and
    the ingest lane."""

    def __init__(self, settings: Settings, engine: RagEngine | None = None):
        self.settings, self.engine = settings, engine
        self.owns_engine = engine is None
        self.ingestor: Ingestor | None = None
        self.scheduler: Scheduler | None = None
        self.lane = Worker(settings.server.queue_size, name="ragblend-ingest")
        self.metrics = Metrics(lambda: self.waiting, lambda: self.running, self._store_stats,
                               lambda: dict(self.scheduler.decode_steps) if self.scheduler else {})
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.stopping: float | None = None  # when shutdown began (monotonic)
        self.created = int(time.time())

    def start(self) -> None:
        self.lane = Worker(self.settings.server.queue_size, name="ragblend-ingest")  # an app may be restarted
        self.scheduler, self.stopping = None, None
        self.lane.start()
        if self.engine is not None:  # given a loaded engine (tests, benchmarks): ready at once
            return self._load()
        threading.Thread(target=self._load, name="ragblend-loader", daemon=True).start()

    def _load(self) -> None:
        try:
            engine = self.engine or RagEngine(self.settings)
            _warm_up(engine)
            s = self.settings.server
            scheduler = Scheduler(engine.parts.blender.decode_step, max_batch=s.max_batch, queue_size=s.queue_size,
                                  slice_s=s.prefill_slice_ms / 1000, prefill_share=s.prefill_share)
            self.ingestor, self.engine, self.scheduler = engine.parts.ingestor, engine, scheduler
            scheduler.start()
            if self.stopping is None:
                self.ready.set()
            log.info("engine ready", extra={"model": self.model_name, "max_batch": s.max_batch})
        except Exception as exc:  # /health reports it; the process stays up to say why
            log.exception("engine failed to load")
            self.load_error = f"{type(exc).__name__}: {exc}"

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
            timer.daemon = True
            timer.start()

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
        if self.owns_engine and self.engine is not None:
            if clean:
                self.engine.parts.close()
            else:  # closing under a running thread could lose a write; the process is ending anyway
                log.warning("work still running at shutdown: store and database left to the process exit")
            self.engine = None
        log.info("stopped", extra={"clean": clean})

    @property
    def model_name(self) -> str:
        return self.engine.parts.llm.name if self.engine else "loading"

    @property
    def waiting(self) -> int:
        return self.lane.waiting + (self.scheduler.waiting if self.scheduler else 0)

    @property
    def running(self) -> int:
        return self.lane.running + (self.scheduler.active if self.scheduler else 0)

    def _store_stats(self) -> dict[str, Any] | None:
        return self.engine.parts.store.stats() if self.ready.is_set() else None

    def health(self) -> dict[str, Any]:
        """The body of /health: status ok | loading | error | stuck | stopping, and the threads' state."""
        report: dict[str, Any] = {"status": "ok", "model": self.model_name}
        scheduler, problem = self.scheduler, None
        if self.load_error:
            report["status"], problem = "error", f"engine failed to load: {self.load_error}"
        elif self.stopping is not None:
            report["status"], problem = "stopping", "the server is shutting down"
        elif scheduler is None:
            report["status"], problem = "loading", "the model is loading"
        elif not scheduler.snapshot()["alive"]:
            report["status"], problem = "error", "the model thread has died"
        elif scheduler.busy_s() > self.settings.server.stuck_after_s:
            report["status"] = "stuck"
            problem = (f"the model thread has been on one piece of work for {scheduler.busy_s():.0f} s "
                       f"(server.stuck_after_s: {self.settings.server.stuck_after_s:g})")
        if scheduler is not None:
            report["model_thread"] = scheduler.snapshot()
        report["ingest"] = self.lane.snapshot()
        blender = getattr(self.engine.parts, "blender", None) if self.engine else None
        if reason := getattr(blender, "unsupported", None):
            report["blend_disabled"] = reason  # the model gate: every prefill runs in full
        if problem:
            report["error"] = ApiError(503, problem, report["status"]).body()["error"]
        return report

    def query_params(self, question: str, *, top_k: int | None, max_tokens: int | None, **rest: Any) -> QueryParams:
        """Engine parameters, with this server's defaults for what the request left out."""
        return QueryParams(question, top_k=top_k or self.settings.retrieval.top_k,
                           max_tokens=max_tokens or self.settings.limits.default_max_new_tokens, **rest)

    async def submit_query(self, params: QueryParams) -> Job:
        """Queue a query for a slot on the model thread and wait until it has one."""
        return await self._started(lambda: self.scheduler.submit(
            lambda cancelled: self.engine.program(params, cancelled), label=params.question[:60]),
            self.scheduler.retry_after)

    async def on_lane(self, request: Request, fn: Callable[[Callable[[], bool]], Any], label: str) -> Any:
        """Run `fn(cancelled)` on the ingest lane and return its result; cancelled if the client leaves."""
        job = await self._started(lambda: self.lane.submit(lambda cancelled: [fn(cancelled)], label),
                                  self.lane.retry_after)
        return await until_done(request, job, job.result())

    async def _started(self, submit: Callable[[], Job], retry_after: Callable[[], int]) -> Job:
        """Queue a job and wait until it starts (429 when full, 503 after the timeout or when stopping)."""
        try:
            job = submit()
        except QueueFull:
            raise ApiError(429, "too many requests waiting; retry later", "queue_full",
                           headers={"Retry-After": str(retry_after())}) from None
        try:
            await job.wait_started(self.settings.server.request_timeout_s)
        except asyncio.CancelledError:
            job.cancel()
            raise
        self.metrics.observe_queue(job.queue_s)
        return job


def _warm_up(engine: RagEngine) -> None:
    """First calls before any concurrency: the prompt head's KV, and one embedding (the embedder's
    tokenizer sets its padding/truncation state on first use; later calls from two threads only read it)."""
    parts = engine.parts
    for warm in (lambda: parts.kv_cache.head(), lambda: parts.embedder.embed(["warm up"])):
        try:
            warm()
        except AttributeError:  # a stand-in engine without these parts
            pass


async def until_done(request: Request, job: Job, awaitable: Any) -> Any:
    """Await `awaitable`; if the client disconnects meanwhile, cancel `job` (it stops at its next check)."""
    async def watch() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(0.25)
        job.cancel()

    watcher = asyncio.create_task(watch())
    try:
        return await awaitable
    finally:
        watcher.cancel()


def service(request: Request) -> Service:
    """The ready service, or 503 while the engine loads or the server stops."""
    svc: Service = request.app.state.service
    if svc.stopping is not None:
        raise WorkerStopped
    if not svc.ready.is_set():
        message = f"engine failed to load: {svc.load_error}" if svc.load_error else "the model is loading"
        raise ApiError(503, message, "loading", headers={"Retry-After": "5"})
    return svc


# ---- queries: shared by /v1/query and /v1/chat/completions -------------------------------------

class QueryRun:
    """One query in a slot on the model thread. `start` waits for its first event, so that errors raised
    before any text (a prompt over the context, say) are still plain HTTP errors rather than broken
    streams; a client that leaves before then cancels it."""

    def __init__(self, svc: Service, job: Job, first: str | QueryResult, rest: AsyncIterator[str | QueryResult]):
        self.svc, self.job, self._first, self._rest = svc, job, first, rest

    @classmethod
    async def start(cls, svc: Service, params: QueryParams, request: Request) -> QueryRun:
        job = await svc.submit_query(params)
        events = aiter(job)
        try:
            return cls(svc, job, await until_done(request, job, anext(events)), events)
        except BaseException:
            job.cancel()
            raise

    async def events(self) -> AsyncIterator[str | QueryResult]:
        """Text deltas, then the QueryResult (recorded in the metrics). The program may work on after its
        result (storing a chat turn's KV); the client need not wait for that."""
        try:
            async for event in self._all():
                yield event
                if isinstance(event, QueryResult):
                    self.svc.metrics.observe_query(event.stats, self.job.queue_s)
                    return
        finally:
            self.cancel()
        # Ended without a result: cancelled (the client left, or the server is stopping).
        raise WorkerStopped if self.svc.stopping is not None else ApiError(503, "the request was cancelled",
                                                                           "cancelled")

    async def _all(self) -> AsyncIterator[str | QueryResult]:
        yield self._first
        async for event in self._rest:
            yield event

    async def result(self, request: Request) -> QueryResult:
        """The QueryResult (non-streaming); a client that leaves meanwhile cancels the query."""
        async def last() -> QueryResult:
            return [event async for event in self.events()][-1]
        return await until_done(request, self.job, last())

    def cancel(self) -> None:
        """Stop the generation (a no-op once it is done)."""
        self.job.cancel()

    def response(self, result: QueryResult) -> QueryResponse:
        result.stats.queue_ms = round(self.job.queue_s * 1000, 2)
        return QueryResponse(answer=result.answer, sources=result.sources, stats=result.stats,
                             finish_reason=result.finish_reason, explain=result.explain)


def sse(run: QueryRun, events: AsyncIterator[ServerSentEvent]) -> EventSourceResponse:
    """Server-sent events; a client that goes away cancels the run, which stops its generation."""
    async def guarded() -> AsyncIterator[ServerSentEvent]:
        try:
            async for event in events:
                yield event
        except Exception as exc:  # the headers are out: report in-band, as OpenAI does
            yield ServerSentEvent(json.dumps(as_api_error(exc).body()), event="error")
        finally:
            run.cancel()
    return EventSourceResponse(guarded(), headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# ---- routes ------------------------------------------------------------------------------------

router = APIRouter()
ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 413, 422, 429, 503)}
SSE = {"content": {"text/event-stream": {}}, "description": "JSON, or server-sent events with stream: true"}


@router.get("/health")
def health(request: Request) -> JSONResponse:
    """200 when the server can answer: the engine is loaded and its model thread is alive and not stuck;
    503 otherwise (loading, failed to load, stuck, shutting down). The body says which, and what the
    model thread and the ingest lane are doing."""
    report = request.app.state.service.health()
    return JSONResponse(report, status_code=200 if report["status"] == "ok" else 503)


@router.get("/health/live")
def health_live(request: Request) -> JSONResponse:
    """Liveness: 503 only when a restart would help (the model thread died or is stuck)."""
    status = request.app.state.service.health()["status"]
    dead = status == "stuck" or (status == "error" and request.app.state.service.load_error is None)
    return JSONResponse({"status": status}, status_code=503 if dead else 200)


@router.get("/health/ready")
def health_ready(request: Request) -> JSONResponse:
    """Readiness: 200 when /health is (send traffic here)."""
    status = request.app.state.service.health()["status"]
    return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)


@router.get("/metrics", response_class=Response)
def metrics(request: Request) -> Response:
    svc: Service = request.app.state.service
    return Response(svc.metrics.render(), media_type=svc.metrics.content_type)


@router.get("/v1/models", response_model=ModelList, responses=ERRORS)
def models(svc: Service = Depends(service)) -> ModelList:
    return ModelList(data=[ModelCard(id=svc.model_name, created=svc.created)])


@router.post("/v1/query", response_model=QueryResponse, responses={200: SSE, **ERRORS})
async def query(body: QueryRequest, request: Request, svc: Service = Depends(service)):
    check_limits(svc.settings.limits, question=body.question, top_k=body.top_k, max_tokens=body.max_tokens)
    params = svc.query_params(body.question, top_k=body.top_k, mode=body.mode, ratio=body.recompute_ratio,
                              selection=body.selection, max_tokens=body.max_tokens, temperature=body.temperature,
                              ignore_eos=body.ignore_eos,
                              explain_tokens=svc.settings.limits.max_explain_tokens if body.explain else 0)
    run = await QueryRun.start(svc, params, request)
    if body.stream:
        return sse(run, query_events(run))
    return run.response(await run.result(request))


async def query_events(run: QueryRun) -> AsyncIterator[ServerSentEvent]:
    """`event: delta` {"delta": text} per piece of text, then `event: result`: the whole response."""
    async for event in run.events():
        if isinstance(event, str):
            yield ServerSentEvent(json.dumps({"delta": event}), event="delta")
        else:
            yield ServerSentEvent(run.response(event).model_dump_json(), event="result")


@router.post("/v1/chat/completions", response_model=ChatCompletion, responses={200: SSE, **ERRORS})
async def chat_completions(body: ChatCompletionRequest, request: Request, svc: Service = Depends(service)):
    """The whole conversation goes into the prompt (app.conversation: system message, earlier turns, the
    new question; retrieval with the question made self-contained); the conversation's KV is reused
    from turn to turn (usage.prompt_tokens_details.cached_tokens counts it)."""
    body.question()  # 422 without a user message
    chat = Conversation.from_messages(body.messages)
    check_limits(svc.settings.limits, question=chat.question, top_k=body.top_k, max_tokens=body.new_tokens(),
                 question_field="messages",
                 max_tokens_field="max_completion_tokens" if body.max_completion_tokens else "max_tokens")
    params = svc.query_params(chat.question, top_k=body.top_k, mode=body.mode, ratio=body.recompute_ratio,
                              max_tokens=body.new_tokens(), temperature=body.temperature or 0.0,
                              top_p=body.top_p or 1.0, stop=tuple(body.stop), seed=body.seed, system=chat.system,
                              turns=chat.turns, retrieval_query=chat.retrieval_query(), remember=True)
    run = await QueryRun.start(svc, params, request)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": svc.model_name}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse(run, chat_chunks(run, head, include_usage))
    result = await run.result(request)
    return ChatCompletion(**head, usage=_usage(result), sources=result.sources,
                          dropped_messages=result.stats.dropped_messages,
                          choices=[Choice(message=ChatMessageOut(content=result.answer),
                                          finish_reason=_finish_reason(result))])


async def chat_chunks(run: QueryRun, head: dict[str, Any], include_usage: bool) -> AsyncIterator[ServerSentEvent]:
    """OpenAI's stream: a role chunk, content chunks, a finish chunk, [a usage chunk,] [DONE]."""
    def chunk(delta: Delta | None, finish: str | None = None, usage: Usage | None = None,
              dropped: int | None = None) -> ServerSentEvent:
        choices = [] if delta is None else [ChunkChoice(delta=delta, finish_reason=finish)]
        return ServerSentEvent(ChatCompletionChunk(**head, choices=choices, usage=usage, dropped_messages=dropped)
                               .model_dump_json(exclude_none=False))

    yield chunk(Delta(role="assistant", content=""))
    async for event in run.events():
        if isinstance(event, str):
            yield chunk(Delta(content=event))
        else:
            yield chunk(Delta(), finish=_finish_reason(event), dropped=event.stats.dropped_messages)
            if include_usage:
                yield chunk(None, usage=_usage(event))
    yield ServerSentEvent("[DONE]")


def _usage(result: QueryResult) -> Usage:
    s = result.stats
    return Usage(prompt_tokens=s.prompt_tokens, completion_tokens=s.completion_tokens,
                 total_tokens=s.prompt_tokens + s.completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=s.cached_tokens))


def _finish_reason(result: QueryResult) -> str:
    return "length" if result.finish_reason == "length" else "stop"  # "cancelled" never reaches a client


# ---- documents ---------------------------------------------------------------------------------

UPLOAD_SCHEMA = {"type": "object", "required": ["file"], "properties": {
    "file": {"type": "string", "format": "binary", "description": f"One of {', '.join(SUFFIXES)}"},
    "id": {"type": "string", "description": "Document id (default: the file name without extension)."},
    "title": {"type": "string"}}}


@router.post("/v1/documents", status_code=201, response_model=IngestResponse, responses=ERRORS,
             openapi_extra=openapi_body(DocumentIn, multipart=UPLOAD_SCHEMA))
async def add_document(request: Request, svc: Service = Depends(service)) -> IngestResponse:
    """Ingest JSON `{id?, title?, text}` or a multipart `file` (.txt, .md, .jsonl) like `ragblend ingest`."""
    content_type = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if content_type == "multipart/form-data":
        docs = await _uploaded_documents(request)
    elif content_type == "application/json":
        docs = [_json_document(await request.body())]
    else:
        raise ApiError(415, f"unsupported content type {content_type!r}: send application/json or "
                            f"multipart/form-data", "unsupported_media_type")
    return IngestResponse(data=await svc.on_lane(request, lambda cancelled: _ingest(svc, docs, cancelled),
                                                 f"upload of {len(docs)} document(s)"))


def _json_document(body: bytes) -> SourceDocument:
    """The JSON upload, parsed and validated as FastAPI does for the other routes."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ApiError(422, f"body: invalid JSON ({'nested too deeply' if isinstance(exc, RecursionError) else exc})",
                       "invalid_body", "body") from None
    try:
        doc = DocumentIn.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
    doc_id = doc.id or "doc-" + hashlib.sha256(doc.text.encode()).hexdigest()[:16]
    return SourceDocument(doc_id, doc.title, doc.text, "api")


async def _uploaded_documents(request: Request) -> list[SourceDocument]:
    """The documents in an uploaded file, read by the same code as `ragblend ingest`; the form's id and
    title pass the same checks as a JSON upload's."""
    form = await request.form()
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise LimitError("file", "a multipart file field named 'file' is required")
    fields = {name: form.get(name) for name in ("id", "title") if form.get(name) is not None}
    try:
        meta = DocumentMeta.model_validate(fields)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
    doc_id, title = meta.id, meta.title
    name = Path(upload.filename or "").name
    if Path(name).suffix.lower() not in SUFFIXES:
        raise LimitError("file", f"unsupported file {name!r}: use {', '.join(SUFFIXES)}")
    data = await upload.read()
    with tempfile.TemporaryDirectory(prefix="ragblend-upload-") as tmp:
        path = Path(tmp) / name
        path.write_bytes(data)
        docs, errors = read_documents(path, str(doc_id).strip() if doc_id else path.stem)
    if errors:
        raise LimitError("file", "; ".join(errors[:5]).replace(tmp + "/", ""))
    ids = [d.doc_id for d in docs]
    if len(set(ids)) != len(ids):
        raise LimitError("file", "duplicate document ids in the file")
    if not docs:
        raise LimitError("file", "the file holds no documents")
    for doc in docs:
        doc.source = doc.source.replace(tmp + "/", "upload:")
        if title and len(docs) == 1:
            doc.title = str(title)
    return docs


def _ingest(svc: Service, docs: list[SourceDocument], cancelled: Callable[[], bool]) -> list[IngestedDocument]:
    """On the ingest lane: chunk all first (bad input fails before anything is written) and embed here,
    precompute each chunk's KV on the model thread (one task per chunk, between other requests' work),
    then commit all or none. Cancelled (client gone, shutdown) between two embedding batches or chunks."""
    def check(_: int = 0) -> None:
        if cancelled():
            raise IngestCancelled("upload cancelled")

    ingestor = replace(svc.ingestor, kv_cache=ModelThreadKV(svc.engine.parts.kv_cache, svc.scheduler, cancelled),
                       on_embedded=check,  # progress after each embedding batch: a place to stop
                       max_chars=svc.settings.limits.max_document_chars)
    prepared = []
    for doc in docs:
        check()
        prepared.append(ingestor.prepare(doc))
    results = ingestor.commit_all(prepared, cancelled)
    return [IngestedDocument(**asdict(_document(svc, r.doc_id)), status=r.status) for r in results]


class ModelThreadKV:
    """The chunk KV cache as the ingest lane uses it: store reads here, each precompute on the model thread."""

    def __init__(self, kv: Any, scheduler: Scheduler, cancelled: Callable[[], bool]):
        self.kv, self.scheduler, self.cancelled = kv, scheduler, cancelled
        self.passage_ids, self.key, self.delete = kv.passage_ids, kv.key, kv.delete

    def ensure(self, ids: Any) -> str:
        if self.kv.store.contains(self.kv.key(ids)):
            return self.kv.key(ids)
        try:
            return self.scheduler.run_on_model(lambda: self.kv.ensure(ids), label="upload: chunk KV precompute",
                                               cancelled=self.cancelled)
        except concurrent.futures.CancelledError:
            raise IngestCancelled("upload cancelled") from None


def _document(svc: Service, doc_id: str) -> DocumentInfo:
    info = svc.engine.parts.retriever.get_document(doc_id)
    if info is None:
        raise ApiError(404, f"no document {doc_id!r}", "not_found", "doc_id")
    return info


@router.get("/v1/documents", response_model=DocumentList, responses=ERRORS)
def list_documents(svc: Service = Depends(service)) -> DocumentList:
    return DocumentList(data=svc.engine.parts.retriever.list_documents())


@router.get("/v1/documents/{doc_id:path}", response_model=DocumentInfo, responses={404: {"model": ErrorResponse}})
def get_document(doc_id: str, svc: Service = Depends(service)) -> DocumentInfo:
    return _document(svc, doc_id)


@router.delete("/v1/documents/{doc_id:path}", response_model=DeletedDocument,
               responses={404: {"model": ErrorResponse}, **ERRORS})
async def delete_document(doc_id: str, request: Request, svc: Service = Depends(service)) -> DeletedDocument:
    def delete(cancelled: Callable[[], bool]) -> DeletedDocument:
        try:
            svc.ingestor.delete(doc_id)
        except KeyError:
            raise ApiError(404, f"no document {doc_id!r}", "not_found", "doc_id") from None
        return DeletedDocument(id=doc_id)
    return await svc.on_lane(request, delete, f"delete {doc_id[:60]}")


# ---- the app -----------------------------------------------------------------------------------

def create_app(settings: Settings, engine: RagEngine | None = None) -> FastAPI:
    """The API over `engine`, or over one loaded from `settings` at startup (in the background)."""
    svc = Service(settings, engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        svc.start()
        yield
        await asyncio.to_thread(svc.stop)  # blocking joins; the loop stays free to deliver last events

    app = FastAPI(title="ragblend", version="0.1.0", lifespan=lifespan,
                  description="RAG answers with CacheBlend chunk-KV reuse; OpenAI-compatible chat completions.")
    app.state.service = svc
    app.include_router(router)
    page = page_routes()
    app.router.routes.extend(page)
    for exc_type in HANDLED:
        app.add_exception_handler(exc_type, handle_error)
    app.add_middleware(LimitBody, max_bytes=settings.limits.max_body_bytes)
    app.add_middleware(RequireApiKey, api_key=settings.server.api_key, public=(*HEALTH_PATHS, *PUBLIC_PATHS),
                       public_prefix=PUBLIC_PREFIX)
    # outermost: sees every status
    app.add_middleware(CountRequests, metrics=svc.metrics, routes=[*router.routes, *page])
    return app


def run_server(settings: Settings, host: str, port: int) -> None:
    """`ragblend serve`. SIGTERM/SIGINT begin our shutdown at once (uploads cancelled, new requests
    refused), while uvicorn stops listening and waits up to `server.shutdown_grace_s` for open requests."""
    import uvicorn

    from app.logs import setup_logging

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # In the signal handler: hand off to a thread (it takes locks this thread may hold).
            threading.Thread(target=app.state.service.begin_shutdown, name="ragblend-shutdown").start()
            super().handle_exit(sig, frame)

        @contextmanager
        def capture_signals(self) -> Iterator[None]:
            # uvicorn's, minus re-raising the signal once stopped: a graceful shutdown exits with code 0.
            handlers = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in handlers.items():
                    signal.signal(sig, handler)

    setup_logging()
    app = create_app(settings)
    # uvicorn waits for open requests a little longer than our grace: by then we have ended them ourselves.
    grace = settings.server.shutdown_grace_s + STOP_MARGIN_S
    Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                          timeout_graceful_shutdown=max(1, round(grace)))).run()
