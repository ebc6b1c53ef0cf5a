"""ASGI middleware of the API: request counting, the API key and the body-size cap.

Pure ASGI rather than BaseHTTPMiddleware, so streamed responses and disconnects pass untouched.
"""
from __future__ import annotations

import hmac
import logging
import time

from starlette.datastructures import Headers
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import ApiError, BodyTooLarge, as_api_error
from app.metrics import Metrics

log = logging.getLogger("ragblend.server")

HEALTH_PATHS = ("/health", "/health/live", "/health/ready")


class CountRequests:
    """Counts every response by route template and status, and logs it (at INFO)."""

    def __init__(self, app: ASGIApp, metrics: Metrics, routes: list[BaseRoute]):
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), 500  # 500 unless a response starts

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            endpoint = next((r.path for r in self.routes if r.matches(scope)[0] == Match.FULL), "unmatched")
            self.metrics.requests.labels(endpoint, str(status)).inc()
            log.info("request", extra={"method": scope["method"], "path": scope["path"], "status": status,
                                       "ms": round((time.perf_counter() - start) * 1000, 1)})


class RequireApiKey:
    """`Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`) on every path but the public ones, when a
    key is configured."""

    def __init__(self, app: ASGIApp, api_key: str | None, public: tuple[str, ...] = HEALTH_PATHS,
                 public_prefix: str | None = None):
        self.app, self.key, self.public, self.public_prefix = app, (api_key or "").encode(), public, public_prefix

    def _is_public(self, path: str) -> bool:
        return path in self.public or bool(self.public_prefix and path.startswith(self.public_prefix))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.key and not self._is_public(scope["path"]):
            headers = Headers(scope=scope)
            scheme, _, token = headers.get("authorization", "").partition(" ")
            bearer = token.strip() if scheme.lower() == "bearer" else None
            if not any(hmac.compare_digest(given.encode(), self.key)
                       for given in (bearer, headers.get("x-api-key")) if given is not None):
                error = ApiError(401, "missing or invalid API key (Authorization: Bearer ... or x-api-key)",
                                 "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                return await error.response_for(scope["path"])(scope, receive, send)
        await self.app(scope, receive, send)


class LimitBody:
    """413 for a body over the limit: at once from Content-Length, else as soon as the stream passes it."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await as_api_error(BodyTooLarge(self.max_bytes)).response_for(scope["path"])(scope, receive, send)
        received, started = 0, False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise BodyTooLarge(self.max_bytes)  # an HTTPException: FastAPI passes it on to the handlers
            return message

        async def watch_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, watch_send)
        except BodyTooLarge as exc:  # read outside FastAPI's handlers (none today): answer here
            if started:
                raise
            await as_api_error(exc).response_for(scope["path"])(scope, receive, send)
