"""The HTTP API assembled: ragblend's own query and document endpoints, OpenAI-compatible chat completions,
health and metrics, the page; and `ragblend serve`, uvicorn running it.

The parts: app/serving/service.py (the lifecycle: loading, the model thread and the ingest lane, health,
shutdown), app/api/query_routes.py (/v1/query, /v1/chat/completions, /v1/models), app/api/openai_completions.py
(/v1/completions), app/api/openai_embeddings.py (/v1/embeddings), app/api/anthropic_routes.py (Anthropic's
/v1/messages), app/api/document_routes.py (/v1/documents and uploads), app/api/cache_routes.py (/v1/cache),
app/api/page.py (the page), app/api/middleware.py (API key, body cap, request counting); health and metrics here.

Every error body is OpenAI-shaped: {"error": {"message", "type", "code", "param"}}; /v1/messages's are
Anthropic's (app/api/errors.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from contextlib import asynccontextmanager, contextmanager
from typing import Any, Iterator

import anyio
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from app.api import anthropic_routes, cache_routes, document_routes, openai_completions, openai_embeddings, query_routes
from app.api.errors import HANDLED, ApiError, handle_error
from app.api.middleware import HEALTH_PATHS, CountRequests, LimitBody, RequireApiKey
from app.api.page import PUBLIC_PATHS, PUBLIC_PREFIX, page_routes
from app.api.schemas.ragblend import state_limits, state_models, state_sizes
from app.components import Components
from app.config import Settings
from app.engine.rag_engine import RagEngine
from app.serving.parts import Engine
from app.serving.service import STOP_MARGIN_S, Service
from app.tenants import current_tenant
from blend.model import served_name
from retrieval import embedder_name

# ---- health and metrics: no API key, answered in every state ------------------------------------

health_router = APIRouter()
HEALTH_503 = {503: {"description": "Not ready: loading, failed to load, stuck or shutting down (the body says)."}}


@health_router.get("/health", responses=HEALTH_503)
def health(request: Request) -> JSONResponse:
    """200 when the server can answer: the engine is loaded and its model thread is alive and not stuck;
    503 otherwise (loading, failed to load, stuck, shutting down). The body says which, and what the
    model thread and the ingest lane are doing."""
    report = request.app.state.service.health()
    return JSONResponse(report, status_code=200 if report["status"] in ("ok", "degraded") else 503)


@health_router.get("/health/live", responses=HEALTH_503)
def health_live(request: Request) -> JSONResponse:
    """Liveness: 503 only when a restart would help (the model thread died or is stuck)."""
    status = request.app.state.service.health()["status"]
    dead = status == "stuck" or (status == "error" and request.app.state.service.load_error is None)
    return JSONResponse({"status": status}, status_code=503 if dead else 200)


@health_router.get("/health/ready", responses=HEALTH_503)
def health_ready(request: Request) -> JSONResponse:
    """Readiness: 200 when /health is (send traffic here)."""
    status = request.app.state.service.health()["status"]
    return JSONResponse({"status": status}, status_code=200 if status in ("ok", "degraded") else 503)


@health_router.get("/metrics", response_class=Response,
                   responses={403: {"description": "Keys are configured and this one is not in server.admin_keys."}})
def metrics(request: Request) -> Response:
    """Prometheus metrics: every tenant's counts, so for admins alone (server.api_key, server.admin_keys) once
    keys are configured."""
    if not current_tenant().admin:
        raise ApiError(403, "/metrics is for admin keys (server.admin_keys): it counts every tenant's requests",
                       "forbidden")
    svc: Service = request.app.state.service
    return Response(svc.metrics.render(), media_type=svc.metrics.content_type)


def create_app(settings: Settings, engine: Engine | None = None) -> FastAPI:
    """The API over `engine`, or over one loaded from `settings` at startup (in the background)."""
    svc = Service(settings, engine, build_engine=lambda s: RagEngine(s, Components(s, svc.housekeeping)))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        svc.start()
        keeping = asyncio.create_task(svc.housekeep())
        yield
        keeping.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keeping  # a task under way ends first
        await anyio.to_thread.run_sync(svc.stop)  # blocking joins; the loop stays free to deliver last events

    app = FastAPI(title="ragblend", version="0.1.0", lifespan=lifespan,
                  description="RAG answers with CacheBlend chunk-KV reuse; OpenAI-compatible chat completions.")
    app.state.service = svc
    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:  # built once (FastAPI keeps it), then this server's limits written in
            state_limits(default_openapi(), settings.limits)
            anthropic_routes.describe(app.openapi_schema, settings.limits)
            state_models(app.openapi_schema, query_routes.served_models(served_name(settings.model.name)),
                         embedder_name(settings.embedder))
            if not svc.ready.is_set():  # the model's sizes are known once it has loaded: built again then
                schema, app.openapi_schema = app.openapi_schema, None
                return schema
            parts = svc.serving.engine.parts
            state_sizes(app.openapi_schema, parts.runtime.vocab, parts.embedder.dim)
        return app.openapi_schema

    app.openapi = openapi
    routers = (health_router, query_routes.router, openai_completions.router, openai_embeddings.router,
               anthropic_routes.router, document_routes.router, cache_routes.router)
    for router in routers:
        app.include_router(router)
    page = page_routes()
    app.router.routes.extend(page)
    for exc_type in HANDLED:
        app.add_exception_handler(exc_type, handle_error)
    app.add_middleware(LimitBody, max_bytes=settings.limits.max_body_bytes)
    app.add_middleware(RequireApiKey, keys=settings.server.tenant_keys(), public=(*HEALTH_PATHS, *PUBLIC_PATHS),
                       public_prefix=PUBLIC_PREFIX, admin_keys=settings.server.admins())
    # outermost: sees every status
    app.add_middleware(CountRequests, metrics=svc.metrics, routes=[*(r for rt in routers for r in rt.routes), *page])
    return app


def run_server(settings: Settings, host: str, port: int) -> None:
    """`ragblend serve`. SIGTERM/SIGINT begin our shutdown at once (uploads cancelled, new requests answered 503
    while the listener stays open), and once running requests end (`server.shutdown_grace_s` at most) uvicorn
    stops listening and waits for the connections still open."""
    import uvicorn

    from app.logs import setup_logging

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # In the signal handler: hand off to a thread (it takes locks this thread may hold).
            threading.Thread(target=self.drain, args=(sig, frame), name="ragblend-shutdown").start()

        def drain(self, sig: int, frame: Any) -> None:
            """Our shutdown first: while running requests finish (the grace at most), the listener stays open
            and a new request gets a 503 shutting_down with Retry-After; then uvicorn stops listening."""
            svc = app.state.service
            svc.begin_shutdown()
            svc.wait_drained(settings.server.shutdown_grace_s)
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
