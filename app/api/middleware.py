"""ASGI middleware of the API: request counting, the API keys (and the tenant each names) and the body-size cap.

Pure ASGI rather than BaseHTTPMiddleware, so streamed responses and disconnects pass untouched.
"""
from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Collection, Mapping

from starlette.datastructures import Headers
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.errors import REFUSALS, ApiError, BodyTooLarge, as_api_error
from app.serving.metrics import Metrics
from app.tenants import TENANT, TENANT_SCOPE_KEY, Tenant

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
            self.metrics.requests.labels(endpoint, str(status), scope.get(TENANT_SCOPE_KEY, Tenant()).label).inc()
            log.info("request", extra={"method": scope["method"], "path": scope["path"], "status": status,
                                       "ms": round((time.perf_counter() - start) * 1000, 1)})


class RequireApiKey:
    """`Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`) on every path but the public ones, when
    keys are configured; the key names the request's tenant (TENANT)."""

    def __init__(self, app: ASGIApp, keys: Mapping[str, str], public: tuple[str, ...] = HEALTH_PATHS,
                 public_prefix: str | None = None, admin_keys: Collection[str] = ()):
        """`keys`: API key -> tenant name; none: no key asked, every request the default tenant (""), an admin.
        `admin_keys`: the keys that are admins."""
        self.app, self.public, self.public_prefix = app, public, public_prefix
        self.keys = [(key.encode(), Tenant(name, admin=key in admin_keys)) for key, name in keys.items()]

    def _is_public(self, path: str) -> bool:
        return path in self.public or bool(self.public_prefix and path.startswith(self.public_prefix))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tenant = Tenant()
        if scope["type"] == "http" and self.keys and not self._is_public(scope["path"]):
            tenant = self._tenant(Headers(scope=scope))
            if tenant is None:
                error = ApiError(401, "missing or invalid API key (Authorization: Bearer ... or x-api-key)",
                                 "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                REFUSALS.log(scope["path"], error)
                return await error.response_for(scope["path"])(scope, receive, send)
        scope[TENANT_SCOPE_KEY], token = tenant, TENANT.set(tenant)
        try:
            await self.app(scope, receive, send)
        finally:
            TENANT.reset(token)

    def _tenant(self, headers: Headers) -> Tenant | None:
        """The tenant of the key the request gives; None: no valid key. Every key compared (constant time)."""
        scheme, _, token = headers.get("authorization", "").partition(" ")
        bearer = token.strip() if scheme.lower() == "bearer" else None
        found = None
        for given in (bearer, headers.get("x-api-key")):
            for key, tenant in self.keys:
                if given is not None and hmac.compare_digest(given.encode(), key) and found is None:
                    found = tenant
        return found


class LimitBody:
    """413 for a body over the limit: at once from Content-Length, else as soon as the stream passes it."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            REFUSALS.log(scope["path"], error := as_api_error(BodyTooLarge(self.max_bytes)))
            return await error.response_for(scope["path"])(scope, receive, send)
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
