"""The driver: the one loop that runs request programs on the model, a step at a time.

A request is a program, a generator run on the thread that owns the model. It yields what its client sees
(text deltas, its result) and, between them, directives:
    Offload(fn)       run fn where it does not hold up the model (retrieval, store reads); resumes with its result
    None              a slice of model work is done (a prefill layer, a chunk's precompute)
    DecodeStep(...)   it needs its next token (blend.decode.decode_loop); every program waiting on one shares
                      one batched forward
`Driver` holds the programs in flight (its slots) and does the stepping: `advance` resumes a program until its
next directive, `decode` runs one batched decode step for every slot waiting on a token and resumes each with
its row. No threads here: app.serving.scheduler runs a Driver on its model thread (and adds the queue, the offload
pool, admission and slice budgets); `Driver.run` runs one program alone on the calling thread, offloads
inline (the CLI, `ragblend compare`, tests and DecodeRuntime.generate).

The decode function's contract (DecodeRuntime.step): one token per row; a step that raises leaves every
row's sequence as it was (its length is moved on only after the forward succeeded), so a row run again writes
the same position again. A failed batched step is therefore retried row by row, and only the faulty row's
program sees the error.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterator, Literal, Sequence

from blend.decode import DecodeStep, Decoding


@dataclass
class Offload:
    """A directive: run `fn` off the model's thread (inline when a program runs alone)."""
    fn: Callable[[], Any]


Program = Generator[Any, Any, None]
# (sequences, tokens, positions) -> each row's next token (blend.runtime.DecodeRuntime.step)
DecodeFn = Callable[[Sequence[Decoding], Sequence[int], Sequence[int]], Sequence[int]]


@dataclass(eq=False)
class Slot:
    """One program in flight. `emit` receives what it yields for its client, and the exception that ended it."""
    program: Program
    emit: Callable[[Any], None]
    state: Literal["ready", "offload", "decode", "done"] = "ready"
    value: Any = None               # what the program resumes with
    error: BaseException | None = None  # ... or what is thrown into it
    step: DecodeStep | None = None  # the token it waits on (state "decode")

    def cancelled(self) -> bool:
        return False


def run_inline(slot: Slot, fn: Callable[[], Any]) -> None:
    """Offload alone: fn runs now, on this thread."""
    try:
        slot.value = fn()
    except Exception as exc:  # noqa: BLE001 - thrown into the program, as an offload thread's error is
        slot.error = exc
    slot.state = "ready"


class Driver:
    """Programs in flight and the stepping of them. `offload(slot, fn)` starts an Offload (the slot is in state
    "offload" until it sets value or error and "ready"); `on_finish(slot)` hears that a program ended."""

    def __init__(self, decode_step: DecodeFn, offload: Callable[[Slot, Callable[[], Any]], None] = run_inline,
                 on_finish: Callable[[Slot], None] = lambda slot: None):
        self.decode_step, self.offload, self.on_finish = decode_step, offload, on_finish
        self.slots: list[Slot] = []
        self.last_step_s = 0.0  # the last batched decode step's forward (the retry included), for budgets

    def add(self, slot: Slot) -> Slot:
        self.slots.append(slot)
        return slot

    def waiting(self) -> list[Slot]:
        """The slots waiting on a decode step (a cancelled one is not stepped)."""
        return [s for s in self.slots if s.state == "decode" and not s.cancelled()]

    def advance(self, slot: Slot) -> bool:
        """Resume `slot` until it yields a directive; True if it can go on at once (it yielded a slice)."""
        while True:
            try:
                if slot.error is not None:
                    error, slot.error = slot.error, None
                    item = slot.program.throw(error)
                else:
                    value, slot.value = slot.value, None
                    item = slot.program.send(value)
            except StopIteration:
                self.finish(slot)
                return False
            except Exception as exc:  # this request's error, for its client only
                slot.emit(exc)
                self.finish(slot)
                return False
            if item is None:
                return True
            if isinstance(item, DecodeStep):
                slot.state, slot.step = "decode", item
                return False
            if isinstance(item, Offload):
                slot.state = "offload"
                self.offload(slot, item.fn)
                return False
            slot.emit(item)

    def decode(self) -> int:
        """One batched decode step for every slot waiting on a token, each then resumed with its row (its next
        token, or the error of its row alone). Returns how many rows ran."""
        slots = self.waiting()
        if not slots:
            return 0
        steps = [s.step for s in slots]
        start = time.monotonic()
        try:
            rows = list(self.decode_step([s.sequence for s in steps], [s.token for s in steps],
                                         [s.position for s in steps]))
        except Exception:  # find the row at fault: each alone (a failed step moved no row on)
            rows = [self._alone(step) for step in steps]
        self.last_step_s = time.monotonic() - start
        for slot, row in zip(slots, rows):
            slot.state, slot.step = "ready", None
            if isinstance(row, BaseException):
                slot.error = row
            else:
                slot.value = row
            self.advance(slot)  # stream the token's text, ask for the next step (or finish)
        return len(slots)

    def _alone(self, step: DecodeStep) -> int | BaseException:
        try:
            return self.decode_step([step.sequence], [step.token], [step.position])[0]
        except Exception as exc:  # noqa: BLE001 - this row's error
            return exc

    def finish(self, slot: Slot) -> None:
        """End `slot`'s program now (done, failed or cancelled): its cleanup runs on this thread."""
        if slot.state == "done":
            return
        slot.state = "done"
        slot.program.close()
        self.slots.remove(slot)
        self.on_finish(slot)

    def run(self, program: Program) -> Iterator[Any]:
        """Run one program alone on this thread: the same steps as a scheduler's, in one slot (this driver's
        offloads run inline). Yields what it yields for its client; its error is raised here. Closing the
        iterator ends the program."""
        events: deque[Any] = deque()
        slot = self.add(Slot(program, events.append))
        try:
            while True:
                if slot.state == "decode":
                    self.decode()
                elif slot.state == "ready":
                    self.advance(slot)
                elif slot.state == "offload":
                    raise RuntimeError("Driver.run needs a driver whose offloads run inline")
                while events:
                    event = events.popleft()
                    if isinstance(event, BaseException):
                        raise event
                    yield event
                if slot.state == "done":
                    return
        finally:
            self.finish(slot)
