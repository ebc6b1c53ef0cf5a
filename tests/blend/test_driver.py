"""The driver (blend.driver) and the decode loop (blend.decode): one program alone runs as in a batch, offloads run
inline, a program's error is its own, a batched step that fails is retried row by row, closing a run closes the
program, and the end of a sequence is decided in one place (TokenStream)."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from blend.decode import DecodeStep, Decoding, SamplingParams, TokenStream, decode_loop
from blend.driver import Driver, Offload, Slot


@dataclass(eq=False)
class Row:
    """A stand-in for a pool slot's sequence: its length, and whether a step over it fails."""
    length: int = 0
    poison: bool = False


class Counting:
    """A decode step for Rows: each row's next token is its token + 1; a step with a poisoned row raises and moves
    no row on (the contract blend.runtime.DecodeRuntime.step keeps)."""

    def __init__(self):
        self.batches: list[int] = []

    def __call__(self, rows, tokens, positions):
        self.batches.append(len(rows))
        if any(row.poison for row in rows):
            raise RuntimeError("corrupt row")
        for row, position in zip(rows, positions):
            row.length = position + 1
        return [token + 1 for token in tokens]


def counting(name: str, n: int, first: int = 0, poison: bool = False):
    row, token = Row(poison=poison), first
    for step in range(n):
        yield f"{name}:{token}"
        if step + 1 < n:
            token = yield DecodeStep(row, token, row.length)


def test_a_program_alone_offloads_inline_and_streams_its_events():
    def program():
        value = yield Offload(lambda: 41)
        yield None  # a slice of model work
        yield value + 1
        yield from counting("a", 3)

    step = Counting()
    assert list(Driver(step).run(program())) == [42, "a:0", "a:1", "a:2"]
    assert step.batches == [1, 1]


def test_a_programs_error_is_raised_to_its_caller_and_an_offloads_error_is_thrown_into_it():
    def failing():
        try:
            yield Offload(lambda: 1 / 0)
        except ZeroDivisionError:
            yield "caught"
        raise ValueError("bad input")

    run = Driver(Counting()).run(failing())
    assert next(run) == "caught"
    with pytest.raises(ValueError, match="bad input"):
        next(run)


def test_closing_a_run_closes_its_program():
    closed = []

    def endless():
        try:
            yield from counting("e", 1000)
        finally:
            closed.append(True)

    driver = Driver(Counting())
    run = driver.run(endless())
    assert [next(run) for _ in range(3)] == ["e:0", "e:1", "e:2"]
    run.close()
    assert closed == [True] and driver.slots == []


def test_a_failed_batched_step_is_retried_row_by_row_and_fails_only_its_row():
    step, events = Counting(), {name: [] for name in "apb"}
    driver = Driver(step)
    for name, poison in (("a", False), ("p", True), ("b", False)):
        slot = driver.add(Slot(counting(name, 4, first=10 * len(driver.slots), poison=poison), events[name].append))
        driver.advance(slot)
    while driver.decode():
        pass
    assert events["a"] == ["a:0", "a:1", "a:2", "a:3"] and events["b"] == ["b:20", "b:21", "b:22", "b:23"]
    assert events["p"][0] == "p:10" and isinstance(events["p"][1], RuntimeError) and len(events["p"]) == 2
    assert step.batches[:4] == [3, 1, 1, 1]  # the batch, then each row alone
    assert driver.slots == []


def sequence(max_new_tokens: int, first: int) -> Decoding:
    return Decoding(pool=None, slot=0, length=5, sampling=SamplingParams(max_new_tokens), first_token=first)


def run_loop(loop, following) -> list:
    """Drive a decode loop by hand, answering step b with following[b]."""
    out, reply = [], None
    while True:
        try:
            item = loop.send(reply)
        except StopIteration:
            return out
        reply = following.pop(0) if isinstance(item, DecodeStep) else None
        if not isinstance(item, DecodeStep):
            out.append(item)


def test_the_end_of_a_sequence_is_decided_by_the_answer_stream():
    answer = TokenStream(eos_ids=frozenset({2}))
    assert run_loop(decode_loop(sequence(10, 7), answer), [8, 2, 9]) == [7, 8, 2]  # the eos is the last id seen
    assert answer.tokens == [7, 8] and answer.ids == [7, 8, 2] and answer.finish_reason == "stop"

    answer = TokenStream(eos_ids=frozenset({2}))
    assert run_loop(decode_loop(sequence(3, 7), answer), [8, 9, 10]) == [7, 8, 9]
    assert answer.finish_reason == "length" and answer.eos is None

    answer = TokenStream()
    assert run_loop(decode_loop(sequence(10, 7), answer, cancelled=lambda: True), [8]) == [7]
    assert answer.finish_reason == "cancelled"
