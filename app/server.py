"""The HTTP API assembled: ragblend's own query and document endpoints, OpenAI-compatible chat completions,
health and metrics, the page; and `ragblend serve`, uvicorn running it.

The parts: app/service.py (the lifecycle: loading, the model thread and the ingest lane, health, shutdown),
app/query_routes.py (/v1/query, /v1/chat/completions, /v1/models), app/openai_completions.py (/v1/completions),
app/openai_embeddings.py (/v1/embeddings), app/anthropic_api.py (Anthropic's /v1/messages), app/document_routes.py
(/v1/documents and uploads), app/cache_routes.py (/v1/cache), app/page.py (the page), app/middleware.py (API key,
body cap, request counting).

Every error body is OpenAI-shaped: {"error": {"message", "type", "code", "param"}}; /v1/messages's are
Anthropic's (app/errors.py).
"""
from __future__ import annotations

import asyncio
import signal
import threading
from contextlib import asynccontextmanager, contextmanager
from typing import Any, Iterator

from fastapi import FastAPI

from app import (anthropic_api, cache_routes, document_routes, openai_completions, openai_embeddings, query_routes,
                 service)
from app.api_models import state_limits, state_models
from app.components import Engine
from app.config import Settings
from app.engine import RagEngine
from app.errors import HANDLED, handle_error
from app.middleware import HEALTH_PATHS, CountRequests, LimitBody, RequireApiKey
from app.page import PUBLIC_PATHS, PUBLIC_PREFIX, page_routes
from blend.model import served_name
from retrieval import embedder_name
from app.service import STOP_MARGIN_S, Service


def create_app(settings: Settings, engine: Engine | None = None) -> FastAPI:
    """The API over `engine`, or over one loaded from `settings` at startup (in the background)."""
    svc = Service(settings, engine, build_engine=RagEngine)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        svc.start()
        yield
        await asyncio.to_thread(svc.stop)  # blocking joins; the loop stays free to deliver last events

    app = FastAPI(title="ragblend", version="0.1.0", lifespan=lifespan,
                  description="RAG answers with CacheBlend chunk-KV reuse; OpenAI-compatible chat completions.")
    app.state.service = svc
    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:  # built once (FastAPI keeps it), then this server's limits written in
            state_limits(default_openapi(), settings.limits)
            anthropic_api.describe(app.openapi_schema, settings.limits)
            state_models(app.openapi_schema, query_routes.served_models(served_name(settings.model.name)),
                         embedder_name(settings.embedder))
        return app.openapi_schema

    app.openapi = openapi
    routers = (service.router, query_routes.router, openai_completions.router, openai_embeddings.router,
               anthropic_api.router, document_routes.router, cache_routes.router)
    for router in routers:
        app.include_router(router)
    page = page_routes()
    app.router.routes.extend(page)
    for exc_type in HANDLED:
        app.add_exception_handler(exc_type, handle_error)
    app.add_middleware(LimitBody, max_bytes=settings.limits.max_body_bytes)
    app.add_middleware(RequireApiKey, keys=settings.server.tenant_keys(), public=(*HEALTH_PATHS, *PUBLIC_PATHS),
                       public_prefix=PUBLIC_PREFIX, pinned_share=settings.server.tenant_pinned_share)
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
