"""The HTTP API: ragblend's own query and document endpoints, and OpenAI-compatible chat completions.

One engine owns the model and one worker thread runs every model call (app.worker), so requests
queue instead of racing: a full queue answers 429, a request that waits past
`server.request_timeout_s` answers 503, and a streaming client that disconnects stops its
generation. The engine loads in a background thread, so /health answers (503) while it loads.

Every error body is OpenAI-shaped: {"error": {"message", "type", "code", "param"}}.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import tempfile
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, AsyncIterator, Callable

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
from app.engine import QueryParams, QueryResult, RagEngine
from app.errors import HANDLED, ApiError, as_api_error, handle_error
from app.ingest import SUFFIXES, Ingestor, SourceDocument, read_documents
from app.metrics import Metrics
from app.middleware import CountRequests, LimitBody, RequireApiKey
from app.page import PUBLIC_PATHS, PUBLIC_PREFIX, page_routes
from app.worker import Job, QueueFull, Worker
from retrieval import DocumentInfo

log = logging.getLogger("ragblend.server")


# ---- the service: engine, ingestor, worker, metrics --------------------------------------------

class Service:
    """Owns the engine (loaded in a background thread) and the worker that runs all its calls."""

    def __init__(self, settings: Settings, engine: RagEngine | None = None):
        self.settings, self.engine = settings, engine
        self.owns_engine = engine is None
        self.ingestor: Ingestor | None = None
        self.worker = Worker(settings.server.queue_size)
        self.metrics = Metrics(lambda: self.worker.waiting, lambda: self.worker.running, self._store_stats)
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.created = int(time.time())

    def start(self) -> None:
        self.worker = Worker(self.settings.server.queue_size)  # a fresh thread: an app may be restarted
        if self.engine is not None:  # given a loaded engine (tests, benchmarks): ready at once
            return self._load()
        threading.Thread(target=self._load, name="ragblend-loader", daemon=True).start()

    def _load(self) -> None:
        try:
            engine = self.engine or RagEngine(self.settings)
            self.ingestor = engine.parts.ingestor
            self.engine = engine
            self.worker.start()
            self.ready.set()
            log.info("engine ready", extra={"model": self.model_name})
        except Exception as exc:  # /health reports it; the process stays up to say why
            log.exception("engine failed to load")
            self.load_error = f"{type(exc).__name__}: {exc}"

    def stop(self) -> None:
        self.ready.clear()
        self.worker.stop()
        if self.owns_engine and self.engine is not None:
            self.engine.parts.close()
            self.engine = None

    @property
    def model_name(self) -> str:
        return self.engine.parts.llm.name if self.engine else "loading"

    def _store_stats(self) -> dict[str, Any] | None:
        return self.engine.parts.store.stats() if self.ready.is_set() else None

    def query_params(self, question: str, *, top_k: int | None, max_tokens: int | None, **rest: Any) -> QueryParams:
        """Engine parameters, with this server's defaults for what the request left out."""
        return QueryParams(question, top_k=top_k or self.settings.retrieval.top_k,
                           max_tokens=max_tokens or self.settings.limits.default_max_new_tokens, **rest)

    async def submit(self, work: Callable[[Callable[[], bool]], Any]) -> Job:
        """Queue `work` for the worker and wait until it starts (429 when full, 503 after the timeout)."""
        try:
            job = self.worker.submit(work)
        except QueueFull:
            raise ApiError(429, "too many requests waiting; retry later", "queue_full",
                           headers={"Retry-After": str(self.worker.retry_after())}) from None
        try:
            await job.wait_started(self.settings.server.request_timeout_s)
        except asyncio.CancelledError:
            job.cancel()
            raise
        self.metrics.observe_queue(job.queue_s)
        return job

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn()` on the worker and return its result."""
        job = await self.submit(lambda cancelled: [fn()])
        return await job.result()


def service(request: Request) -> Service:
    """The ready service, or 503 while the engine loads."""
    svc: Service = request.app.state.service
    if not svc.ready.is_set():
        message = f"engine failed to load: {svc.load_error}" if svc.load_error else "the model is loading"
        raise ApiError(503, message, "loading", headers={"Retry-After": "5"})
    return svc


# ---- queries: shared by /v1/query and /v1/chat/completions -------------------------------------

class QueryRun:
    """One query on the worker. `start` waits for its first event, so that errors raised before any
    text (a prompt over the context, say) are still plain HTTP errors rather than broken streams."""

    def __init__(self, svc: Service, job: Job, first: str | QueryResult, rest: AsyncIterator[str | QueryResult]):
        self.svc, self.job, self._first, self._rest = svc, job, first, rest

    @classmethod
    async def start(cls, svc: Service, params: QueryParams) -> QueryRun:
        job = await svc.submit(lambda cancelled: svc.engine.stream(params, cancelled=cancelled))
        events = aiter(job)
        try:
            return cls(svc, job, await anext(events), events)
        except BaseException:
            job.cancel()
            raise

    async def events(self) -> AsyncIterator[str | QueryResult]:
        """Text deltas, then the QueryResult (recorded in the metrics)."""
        try:
            async for event in self._all():
                if isinstance(event, QueryResult):
                    self.svc.metrics.observe_query(event.stats, self.job.queue_s)
                yield event
        finally:
            self.cancel()

    async def _all(self) -> AsyncIterator[str | QueryResult]:
        yield self._first
        async for event in self._rest:
            yield event

    async def result(self) -> QueryResult:
        return [event async for event in self.events()][-1]

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
    """200 once the engine is ready; 503 while it loads or if it failed to."""
    svc: Service = request.app.state.service
    if svc.ready.is_set():
        return JSONResponse({"status": "ok", "model": svc.model_name})
    status = "error" if svc.load_error else "loading"
    error = ApiError(503, svc.load_error or "the model is loading", status)
    return JSONResponse({"status": status, **error.body()}, status_code=503)


@router.get("/metrics", response_class=Response)
def metrics(request: Request) -> Response:
    svc: Service = request.app.state.service
    return Response(svc.metrics.render(), media_type=svc.metrics.content_type)


@router.get("/v1/models", response_model=ModelList, responses=ERRORS)
def models(svc: Service = Depends(service)) -> ModelList:
    return ModelList(data=[ModelCard(id=svc.model_name, created=svc.created)])


@router.post("/v1/query", response_model=QueryResponse, responses={200: SSE, **ERRORS})
async def query(body: QueryRequest, svc: Service = Depends(service)):
    check_limits(svc.settings.limits, question=body.question, top_k=body.top_k, max_tokens=body.max_tokens)
    params = svc.query_params(body.question, top_k=body.top_k, mode=body.mode, ratio=body.recompute_ratio,
                              selection=body.selection, max_tokens=body.max_tokens, temperature=body.temperature,
                              explain_tokens=svc.settings.limits.max_explain_tokens if body.explain else 0)
    run = await QueryRun.start(svc, params)
    if body.stream:
        return sse(run, query_events(run))
    return run.response(await run.result())


async def query_events(run: QueryRun) -> AsyncIterator[ServerSentEvent]:
    """`event: delta` {"delta": text} per piece of text, then `event: result`: the whole response."""
    async for event in run.events():
        if isinstance(event, str):
            yield ServerSentEvent(json.dumps({"delta": event}), event="delta")
        else:
            yield ServerSentEvent(run.response(event).model_dump_json(), event="result")


@router.post("/v1/chat/completions", response_model=ChatCompletion, responses={200: SSE, **ERRORS})
async def chat_completions(body: ChatCompletionRequest, svc: Service = Depends(service)):
    question = body.question()
    check_limits(svc.settings.limits, question=question, top_k=body.top_k, max_tokens=body.new_tokens(),
                 question_field="messages",
                 max_tokens_field="max_completion_tokens" if body.max_completion_tokens else "max_tokens")
    params = svc.query_params(question, top_k=body.top_k, mode=body.mode, ratio=body.recompute_ratio,
                              max_tokens=body.new_tokens(), temperature=body.temperature or 0.0,
                              top_p=body.top_p or 1.0, stop=tuple(body.stop), seed=body.seed)
    run = await QueryRun.start(svc, params)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": svc.model_name}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse(run, chat_chunks(run, head, include_usage))
    result = await run.result()
    return ChatCompletion(**head, usage=_usage(result), sources=result.sources,
                          choices=[Choice(message=ChatMessageOut(content=result.answer),
                                          finish_reason=_finish_reason(result))])


async def chat_chunks(run: QueryRun, head: dict[str, Any], include_usage: bool) -> AsyncIterator[ServerSentEvent]:
    """OpenAI's stream: a role chunk, content chunks, a finish chunk, [a usage chunk,] [DONE]."""
    def chunk(delta: Delta | None, finish: str | None = None, usage: Usage | None = None) -> ServerSentEvent:
        choices = [] if delta is None else [ChunkChoice(delta=delta, finish_reason=finish)]
        return ServerSentEvent(ChatCompletionChunk(**head, choices=choices, usage=usage).model_dump_json())

    yield chunk(Delta(role="assistant", content=""))
    async for event in run.events():
        if isinstance(event, str):
            yield chunk(Delta(content=event))
        else:
            yield chunk(Delta(), finish=_finish_reason(event))
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
    return IngestResponse(data=await svc.call(lambda: _ingest(svc, docs)))


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


def _ingest(svc: Service, docs: list[SourceDocument]) -> list[IngestedDocument]:
    """On the worker: chunk all first (bad input fails before anything is written), then commit all or none."""
    prepared = [svc.ingestor.prepare(doc) for doc in docs]
    results = svc.ingestor.commit_all(prepared)
    return [IngestedDocument(**asdict(_document(svc, r.doc_id)), status=r.status) for r in results]


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
async def delete_document(doc_id: str, svc: Service = Depends(service)) -> DeletedDocument:
    def delete() -> DeletedDocument:
        try:
            svc.ingestor.delete(doc_id)
        except KeyError:
            raise ApiError(404, f"no document {doc_id!r}", "not_found", "doc_id") from None
        return DeletedDocument(id=doc_id)
    return await svc.call(delete)


# ---- the app -----------------------------------------------------------------------------------

def create_app(settings: Settings, engine: RagEngine | None = None) -> FastAPI:
    """The API over `engine`, or over one loaded from `settings` at startup (in the background)."""
    svc = Service(settings, engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        svc.start()
        yield
        svc.stop()

    app = FastAPI(title="ragblend", version="0.1.0", lifespan=lifespan,
                  description="RAG answers with CacheBlend chunk-KV reuse; OpenAI-compatible chat completions.")
    app.state.service = svc
    app.include_router(router)
    page = page_routes()
    app.router.routes.extend(page)
    for exc_type in HANDLED:
        app.add_exception_handler(exc_type, handle_error)
    app.add_middleware(LimitBody, max_bytes=settings.limits.max_body_bytes)
    app.add_middleware(RequireApiKey, api_key=settings.server.api_key, public=("/health", *PUBLIC_PATHS),
                       public_prefix=PUBLIC_PREFIX)
    # outermost: sees every status
    app.add_middleware(CountRequests, metrics=svc.metrics, routes=[*router.routes, *page])
    return app


def run_server(settings: Settings, host: str, port: int) -> None:
    """`ragblend serve`."""
    import uvicorn

    from app.logs import setup_logging

    setup_logging()
    uvicorn.run(create_app(settings), host=host, port=port, log_level="warning", access_log=False,
                timeout_graceful_shutdown=5)
