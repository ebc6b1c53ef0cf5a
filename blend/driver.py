"""The driver: requests as data, the step a scheduler builds from them, and the runner that executes it.

A request is state, not a frame: its phase (prepare -> prefill -> decode -> done), the prefill work it has had
(`served`, in token-layers: one token through one layer), its last prefill slice's cost (the next one's estimate),
its decoding sequence (blend.decode.Decoding: position, tokens, where it ends) and whether it must end (`halt`:
its client left, or its output side saw a stop string). Each round:
    schedule(requests, budget, layers) -> Step   a pure function of that state: which requests end, which decode
                                                 rows run, which prefill slices, within a token budget
    Runner.run(step, requests)                   on the model thread: each slice advances a request's prefill by
                                                 its work (blend's resumable prefill, Blender.prefill_steps, yields
                                                 after each layer chunk: server.prefill_chunk_tokens); one batched
                                                 step (DecodeRuntime.advance) for the decode rows; then the outputs
                                                 go out: each request's new token ids once per step (`emit`), and a
                                                 request that ended its final record
The token budget (vLLM's max_num_batched_tokens): a decode row costs one token through every layer, a prefill slice
the tokens it runs through one layer. Every decode row runs each step (a stream is never starved); the prefill work
left goes to the least served request (least attained service: a newcomer has had none, so its first slice runs
in the next step, and a short request sent during a long prefill finishes first; long ones take turns a step
each), and at least one slice runs each step, so prefill always moves on. A step lists its slices, so a runner
that batches several requests' prefill in one forward needs no new scheduling.

Everything after a token id (detokenising, stop strings, tool calls, events) is the output side's, off the model
thread (app.engine.rag_engine.QueryOutput). A stop string ends a request at its next step; the tokens decoded
meanwhile are never shown. app.serving.scheduler runs the rounds on its model thread (with the queue, admission,
`prepare` on an offload pool, model tasks); `run_alone` runs one request on the calling thread (the CLI, tests).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Iterable, Iterator, Literal, Mapping, Protocol, Sequence

from blend.decode import Decoding

Advance = Callable[[Sequence[Decoding]], Sequence["int | BaseException"]]  # blend.runtime.DecodeRuntime.advance
ALONE_BUDGET = 1 << 40  # tokens a step may run for a request alone: its prefill in one step (nothing waits on it)


class Work(Protocol):
    """One request's model work, as its engine defines it (app.engine.rag_engine.Query)."""

    def prepare(self) -> None:
        """Off the model thread: what needs no model (retrieval, the plan, store reads)."""

    def prefill(self) -> Generator[int | None, None, Decoding]:
        """On the model thread: the prefill a slice at a time (each yields the token-layers it ran), then the
        decoding sequence, its first token chosen and accepted."""

    def finish(self, sequence: Decoding, reason: str) -> Any:
        """On the model thread, after the last token (reason "stop" | "length"): the record its output gets last."""


class Output(Protocol):
    """A request's output side: `feed(item)` turns what the runner emits into what the client sees; `stopped`
    once a stop string has ended the answer."""

    stopped: bool

    def feed(self, item: Any) -> Iterable[Any]: ...


@dataclass(eq=False)
class Request:
    """A request's state, as the scheduler reads it. `emit` receives its token ids (a list per step), then its
    final record, or the exception that ended it."""
    work: Work
    emit: Callable[[Any], None]
    id: int = 0
    phase: Literal["prepare", "prefill", "decode", "done"] = "prepare"
    served: int = 0       # token-layers of prefill run so far (its attained service)
    slice_cost: int = 0   # token-layers of its last prefill slice (0: none run yet)
    halt: str | None = None  # "cancelled" (its client left) | "stop" (its output saw a stop string): it ends
    sequence: Decoding | None = None
    steps: Generator[int | None, None, Decoding] | None = field(default=None, repr=False)  # its prefill's frames


@dataclass(frozen=True)
class PrefillSlice:
    """Advance request `request`'s prefill by about `work` token-layers: whole layer chunks, at least one."""
    request: int
    work: int


@dataclass(frozen=True)
class Step:
    """One round's work: the requests that end first (id, reason), the prefill slices, the decode rows (ids)."""
    end: tuple[tuple[int, str], ...] = ()
    prefill: tuple[PrefillSlice, ...] = ()
    decode: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.end or self.prefill or self.decode)


def schedule(requests: Iterable[Request], budget: int, layers: int) -> Step:
    """The step for requests in these states: a pure function (see the module docstring for the rule). `budget`:
    tokens a step may run (a decode row is one, a slice the tokens it runs / `layers`)."""
    live = [r for r in requests if r.phase != "done"]
    end = tuple((r.id, r.halt) for r in live if r.halt)
    running = [r for r in live if not r.halt]
    decode = tuple(r.id for r in running if r.phase == "decode")
    left = (budget - len(decode)) * layers
    prefilling = sorted((r for r in running if r.phase == "prefill"), key=lambda r: (r.served, r.id))
    prefill = (PrefillSlice(prefilling[0].id, max(left, 1)),) if prefilling else ()
    return Step(end, prefill, decode)


class Runner:
    """Executes steps on the thread that owns the model. `advance` is the batched decode step
    (DecodeRuntime.advance); `on_end(request)` hears that a request ended (its record or error already emitted).
    For metrics and model tasks' share: `last_decode`, the last step's decode rows and the seconds they took;
    `prefilled`, the token-layers of prefill run so far."""

    def __init__(self, advance: Advance, on_end: Callable[[Request], None] = lambda request: None):
        self.advance, self.on_end = advance, on_end
        self.last_decode: tuple[int, float] = (0, 0.0)
        self.prefilled = 0

    def run(self, step: Step, requests: Mapping[int, Request]) -> None:
        for id, reason in step.end:
            self.end(requests[id], reason)
        for piece in step.prefill:
            self._prefill(requests[piece.request], piece.work)
        rows = [requests[id] for id in step.decode if requests[id].phase == "decode"]
        if rows:
            self._decode(rows)

    def _prefill(self, request: Request, work: int) -> None:
        if request.steps is None:
            request.steps = request.work.prefill()
        spent = 0
        try:
            while True:
                cost = next(request.steps) or 0
                request.served, spent, self.prefilled = request.served + cost, spent + cost, self.prefilled + cost
                request.slice_cost = cost or request.slice_cost
                if spent + request.slice_cost > work:
                    return
        except StopIteration as done:
            request.steps, request.sequence, request.phase = None, done.value, "decode"
            request.emit([request.sequence.last])  # the first token, chosen from the prefill's logits
            self._ended(request)
        except Exception as exc:  # this request's error (bad input, a corrupt chunk), for its client only
            self._fail(request, exc)

    def _decode(self, rows: list[Request]) -> None:
        start = time.monotonic()
        tokens = self.advance([r.sequence for r in rows])
        self.last_decode = (len(rows), time.monotonic() - start)
        for request, token in zip(rows, tokens):
            if isinstance(token, BaseException):
                self._fail(request, token)
            else:
                request.emit([token])
                self._ended(request)

    def _ended(self, request: Request) -> None:
        """Finish `request` if its last token has been taken."""
        if request.sequence.finish_reason is not None:
            self.end(request, request.sequence.finish_reason)

    def end(self, request: Request, reason: str) -> None:
        """End `request` now: done ("stop", "length": its record is emitted) or cancelled; its slot is given back."""
        if request.phase == "done":
            return
        if reason != "cancelled" and request.phase == "decode":
            try:
                request.emit(request.work.finish(request.sequence, reason))
            except Exception as exc:  # noqa: BLE001 - this request's error
                request.emit(exc)
        self.close(request)

    def _fail(self, request: Request, exc: BaseException) -> None:
        request.emit(exc)
        self.close(request)

    def close(self, request: Request) -> None:
        """Give back what `request` holds (its prefill's frames, its pool slot); it is done."""
        if request.phase == "done":
            return
        request.phase = "done"
        if request.steps is not None:
            request.steps.close()
        if request.sequence is not None:
            request.sequence.release()
        self.on_end(request)


def drain(steps: Generator[Any, None, Any]) -> Any:
    """A resumable piece of work (a prefill) run to its end at once: its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def run_alone(work: Work, output: Output, advance: Advance, layers: int,
              cancelled: Callable[[], bool] = lambda: False) -> Iterator[Any]:
    """One request alone on this thread, through the same schedule and runner as the server's (its prepare
    inline): yields what its output makes of each item; its error is raised here. Closing the iterator ends it."""
    events: deque[Any] = deque()
    request, runner = Request(work, events.append, phase="prefill"), Runner(advance)
    try:
        work.prepare()
        while True:
            if request.halt is None and cancelled():
                request.halt = "cancelled"
            runner.run(schedule([request], ALONE_BUDGET, layers), {request.id: request})
            while events:
                item = events.popleft()
                if isinstance(item, BaseException):
                    raise item
                yield from output.feed(item)
                if output.stopped and request.halt is None:
                    request.halt = "stop"
            if request.phase == "done":
                return
    finally:
        runner.close(request)
