"""The web page: static files under app/api/static, served at / and /static/ without the API key
(the page asks for the key and sends it with each API call)."""
from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parent / "static"
PUBLIC_PATHS = ("/", "/favicon.ico")
PUBLIC_PREFIX = "/static/"
# Only our own files: no inline script, no other origin (the page works offline).
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'")


def index(request: Request) -> FileResponse:
    return FileResponse(STATIC / "index.html", headers={"Content-Security-Policy": CSP, "Cache-Control": "no-cache"})


def favicon(request: Request) -> FileResponse:
    return FileResponse(STATIC / "favicon.svg", media_type="image/svg+xml")


def page_routes() -> list[BaseRoute]:
    """Plain Starlette routes: they stay out of the OpenAPI schema."""
    return [Route("/", index, methods=["GET", "HEAD"]), Route("/favicon.ico", favicon, methods=["GET", "HEAD"]),
            Mount("/static", StaticFiles(directory=STATIC), name="static")]
