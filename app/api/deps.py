"""What the routes depend on: the ready service and its parts (FastAPI dependencies), and work that stops when
its client leaves."""
from __future__ import annotations

import asyncio
from typing import Any, Callable

from fastapi import Depends, Request

from app.api.errors import ApiError
from app.serving.parts import Serving
from app.serving.service import Service
from app.serving.worker import Job, WorkerStopped


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
    """The ready service, or 503 while the engine loads or the server stops (a route dependency)."""
    svc: Service = request.app.state.service
    if svc.stopping is not None:
        raise WorkerStopped
    if not svc.ready.is_set():
        message = f"engine failed to load: {svc.load_error}" if svc.load_error else "the model is loading"
        raise ApiError(503, message, "loading")
    return svc


def serving(svc: Service = Depends(service)) -> Serving:
    """The ready service's parts (a route dependency)."""
    return svc.serving


async def on_lane(request: Request, svc: Service, fn: Callable[[Callable[[], bool]], Any], label: str,
                  yields: bool = False) -> Any:
    """Run `fn(cancelled)` on the ingest lane (behind uploads and deletes if it `yields`) and return its result;
    cancelled if the client leaves."""
    job = await svc.start_on_lane(fn, label, yields)
    return await until_done(request, job, job.result())
