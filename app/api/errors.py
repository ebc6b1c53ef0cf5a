"""API errors: every failure becomes an OpenAI-shaped body {"error": {"message", "type", "code", "param"}}, or
on the Anthropic Messages API (paths under ANTHROPIC_PATH) Anthropic's {"type": "error", "error": {"type",
"message"}}, a 422 there being Anthropic's 400.

`as_api_error` is the one place that decides which exception means which status.
"""
from __future__ import annotations

import errno
import logging
import sqlite3
import time
from typing import Any, Callable

import psycopg
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.routing import Match

from app.api.schemas.ragblend import LimitError
from app.engine.ingest import DocumentExists, DocumentTooLarge, IngestCancelled, IngestError
from app.engine.query import RequestError
from app.serving.service import Refused
from app.serving.worker import QueueTimeout, WorkerStopped
from app.validation import PATTERN_RULES

log = logging.getLogger("ragblend.server")

CLIENT_GONE = 499  # nginx's "client closed request": what /metrics counts for a client that left unanswered
ERROR_TYPES = {499: "client_closed_request", 400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
               409: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
               422: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable", 507: "server_error"}
# The `code` of errors raised without one: every error body has a non-null code.
HTTP_CODES = {400: "invalid_request", 401: "invalid_api_key", 403: "forbidden", 404: "not_found",
              405: "method_not_allowed", 409: "conflict", 413: "payload_too_large", 415: "unsupported_media_type",
              422: "invalid_value", 429: "rate_limited", 500: "internal_error", 503: "unavailable", 507: "disk_full"}
ANTHROPIC_PATH = "/v1/messages"
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                   429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}
DISK_FULL_RETRY_S = 60  # Retry-After of a 507: space is freed by an operator, not in seconds
# How a full disk shows: errno on a file write; SQLite's and PostgreSQL's (psycopg DiskFull) messages.
DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
DISK_FULL_MESSAGES = ("database or disk is full", "no space left on device", "could not extend file")
UNAVAILABLE_RETRY_S = 5  # Retry-After of a 503 without a better estimate (loading, shutting down, cancelled)


class ApiError(Exception):
    """An error as the client sees it. A 503 always says when to retry (Retry-After)."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        if status == 503:
            headers = {"Retry-After": str(UNAVAILABLE_RETRY_S), **(headers or {})}
        self.status, self.message, self.param, self.headers = status, message, param, headers
        self.code = code or HTTP_CODES.get(status, "error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "server_error"),
                          "code": self.code, "param": self.param}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    @property
    def anthropic_status(self) -> int:
        return 400 if self.status in (409, 415, 422) else self.status  # Anthropic's invalid requests are 400s

    def anthropic_body(self) -> dict[str, Any]:
        return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(self.anthropic_status, "api_error"),
                                           "message": self.message}}

    def response_for(self, path: str) -> JSONResponse:
        """The response in the dialect of the API `path` belongs to."""
        if path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/"):
            return JSONResponse(self.anthropic_body(), status_code=self.anthropic_status, headers=self.headers)
        return self.response()


class ClientGone(Exception):
    """The client disconnected before its answer: the work was cancelled, nobody is left to answer."""


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"request body over the {limit}-byte limit")


def disk_full(exc: BaseException | None) -> bool:
    """Whether `exc` (or what caused it) says the disk is full."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS or type(exc).__name__ == "DiskFull" or \
                any(m in str(exc).lower() for m in DISK_FULL_MESSAGES):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def as_api_error(exc: Exception) -> ApiError:
    """Every exception the API can meet, as the error the client sees."""
    if disk_full(exc):  # whatever layer met it: the write was rolled back, the client may retry later
        return ApiError(507, "the data disk is full: nothing was written; retry once space is freed", "disk_full",
                        headers={"Retry-After": str(DISK_FULL_RETRY_S)})
    match exc:
        case ApiError():
            return exc
        case RequestValidationError():
            return _validation_error(exc.errors())
        case LimitError():
            return ApiError(422, str(exc), "invalid_value", exc.param)
        case DocumentTooLarge():
            return ApiError(413, str(exc), "document_too_large")
        case DocumentExists():
            return ApiError(409, str(exc), "document_exists", "id")
        case IngestError():
            return ApiError(422, str(exc), "invalid_document")
        case RequestError():
            return ApiError(400, str(exc), "invalid_request")
        case Refused():
            return ApiError(exc.status, str(exc), exc.code, headers={"Retry-After": str(exc.retry_after_s)})
        case QueueTimeout():
            return ApiError(503, "timed out waiting in the queue; retry later", "queue_timeout")
        case WorkerStopped():
            return ApiError(503, "the server is shutting down", "shutting_down")
        case ClientGone():
            return ApiError(CLIENT_GONE, "the client disconnected; its request was cancelled", "client_gone")
        case IngestCancelled():  # the client left, or the server is stopping: nothing was committed
            return ApiError(503, f"{exc}; nothing was committed", "cancelled")
        case HTTPException() if exc.status_code == 400:  # the body could not be parsed (JSON or multipart)
            reason = exc.__cause__ or exc.detail
            if isinstance(reason, RecursionError):
                reason = "nested too deeply"
            return ApiError(422, f"body: cannot be parsed ({reason})", "invalid_body", "body")
        case HTTPException():
            return ApiError(exc.status_code, str(exc.detail), headers=exc.headers)
    log.error("unhandled error", exc_info=exc)
    return ApiError(500, f"internal error: {type(exc).__name__}", "internal_error")


def _validation_error(errors: list[dict[str, Any]]) -> ApiError:
    """422 naming the first bad field as `param` ("messages.0.role"); every problem in the message."""
    if errors and errors[0].get("type") == "json_invalid":
        reason = errors[0].get("ctx", {}).get("error", errors[0].get("msg"))
        return ApiError(422, f"body: invalid JSON ({reason})", "invalid_body", "body")
    problems = located(errors)
    return ApiError(422, "; ".join(f"{field}: {rule}" for field, rule in problems[:5]) or "invalid request",
                    "invalid_value", problems[0][0] if problems else None)


def located(errors: list[dict[str, Any]], rule: Callable[[dict[str, Any]], str] | None = None
            ) -> list[tuple[str, str]]:
    """(field, rule) of each of pydantic's errors, in words: the field as the client wrote it ("messages.0.role":
    no union branch's internal name), the rule as the schema states it; of a union's branches, those that got
    deepest (a list's item rather than "should be a string")."""
    found = [(tuple(p for p in e.get("loc", ()) if p not in ("body", "query", "path") and not _branch(p)),
              (rule or rule_of)(e)) for e in errors]
    deepest = max((len(where) for where, _ in found), default=0)
    return list(dict.fromkeys((".".join(map(str, where)) or "body", why) for where, why in found
                              if len(where) == deepest))


def _branch(part: Any) -> bool:
    """A union branch's or validator's name in pydantic's location ("list[constrained-int]")."""
    return isinstance(part, str) and any(c in part for c in "[(<")


def rule_of(error: dict[str, Any]) -> str:
    """One error's rule, in words: a pattern by what it means, a validator's message without pydantic's prefix."""
    if error.get("type") == "string_pattern_mismatch":
        return PATTERN_RULES.get(error.get("ctx", {}).get("pattern"), "does not match the field's pattern")
    return str(error.get("msg", "invalid")).removeprefix("Value error, ")


class Refusals:
    """Each refused request's reason at WARNING (a 4xx or 5xx; a client that left: one INFO line), as an access log
    would, each (status, code, path) at most once per `every_s` with the count of those left out meanwhile."""

    def __init__(self, every_s: float = 10.0):
        self.every_s, self.last = every_s, {}  # (status, code, path) -> (logged at, left out since)

    def log(self, path: str, error: ApiError) -> None:
        if error.status == CLIENT_GONE:
            log.info("client disconnected", extra={"path": path})
            return
        key, now = (error.status, error.code, path), time.monotonic()
        at, left_out = self.last.get(key, (None, 0))
        if at is not None and now - at < self.every_s:
            self.last[key] = (at, left_out + 1)
            return
        self.last[key] = (now, 0)
        log.warning("refused" if error.status < 500 else "failed",
                    extra={"path": path, "status": error.status, "code": error.code, "reason": error.message,
                           **({"repeated": left_out} if left_out else {})})


REFUSALS = Refusals()


async def handle_error(request: Request, exc: Exception) -> JSONResponse:
    error = as_api_error(exc)
    REFUSALS.log(request.url.path, error)
    if error.code == "disk_full":
        log.warning("disk full", extra={"path": request.url.path, "error": f"{type(exc).__name__}: {exc}"})
        request.app.state.service.disk_full_at = time.monotonic()  # /health: degraded
    if error.status == 405:  # Starlette's Allow names the first route of the path only: name every route's
        error.headers = {**(error.headers or {}), "Allow": ", ".join(_allowed_methods(request))}
    return error.response_for(request.url.path)


def _allowed_methods(request: Request) -> list[str]:
    """The methods some route of the app answers on the request's path."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        if route.matches(request.scope)[0] != Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return sorted(methods)


# What create_app registers `handle_error` for (Exception last: the 500 of last resort, which the server also
# logs as unhandled). The databases' and the file system's errors are named so a full disk is an answer (507).
HANDLED = (ApiError, ClientGone, Refused, RequestValidationError, HTTPException, LimitError, IngestError,
           RequestError, QueueTimeout, WorkerStopped, IngestCancelled, OSError, sqlite3.OperationalError,
           psycopg.OperationalError, Exception)
