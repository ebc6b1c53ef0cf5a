"""The driver (blend.driver): the schedule as a pure function of request states (no threads, no clocks), the
runner that executes a step, and one request alone through both; where a sequence ends (Decoding.accept)."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from blend.decode import Decoding, SamplingParams
from blend.driver import PrefillSlice, Request, Runner, Step, run_alone, schedule

LAYERS, BUDGET = 4, 100  # a step: 400 token-layers


def state(id: int, phase: str, served: int = 0, halt: str | None = None) -> Request:
    return Request(None, lambda item: None, id, phase, served=served, halt=halt)


def test_every_decode_row_runs_and_the_prefill_budget_left_goes_to_the_least_served():
    requests = [state(0, "prefill", served=5000), state(1, "decode"), state(2, "prefill", served=40),
                state(3, "decode"), state(4, "prepare")]
    assert schedule(requests, BUDGET, LAYERS) == Step(prefill=(PrefillSlice(2, (BUDGET - 2) * LAYERS),),
                                                      decode=(1, 3))


def test_a_newcomer_gets_the_next_step_and_equals_take_turns_in_arrival_order():
    long = state(0, "prefill", served=12_000)
    newcomer = state(7, "prefill")
    assert schedule([long, newcomer], BUDGET, LAYERS).prefill[0].request == 7
    twins = [state(3, "prefill", served=10), state(1, "prefill", served=10)]
    assert schedule(twins, BUDGET, LAYERS).prefill[0].request == 1


def test_a_step_runs_one_slice_at_least_and_ends_halted_requests_first():
    crowded = [state(i, "decode") for i in range(BUDGET + 3)] + [state(999, "prefill")]
    assert schedule(crowded, BUDGET, LAYERS).prefill == (PrefillSlice(999, 1),)  # prefill never starves
    requests = [state(0, "decode", halt="cancelled"), state(1, "decode", halt="stop"), state(2, "decode"),
                state(3, "prefill", halt="cancelled"), state(4, "done")]
    assert schedule(requests, BUDGET, LAYERS) == Step(end=((0, "cancelled"), (1, "stop"), (3, "cancelled")),
                                                      decode=(2,))
    assert not schedule([state(0, "prepare"), state(1, "done")], BUDGET, LAYERS)


@dataclass(eq=False)
class Sequence:
    """A stand-in for blend.decode.Decoding: `n` tokens, each the last + 1; whether the runner released it."""
    n: int
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    released: bool = False
    poison: bool = False

    @property
    def last(self) -> int:
        return self.tokens[-1]

    def accept(self, token: int) -> None:
        self.tokens.append(token)
        self.finish_reason = "length" if len(self.tokens) == self.n else None

    def release(self) -> None:
        self.released = True


def advance(sequences) -> list:
    """The batched step for Sequences: a poisoned row gets its own error (as DecodeRuntime.advance's retry)."""
    rows = []
    for s in sequences:
        if s.poison:
            rows.append(RuntimeError("corrupt row"))
        else:
            s.accept(s.last + 1)
            rows.append(s.last)
    return rows


class Work:
    """A request's work: `slices` prefill slices of `cost` token-layers each (logged), then `n` tokens from
    `first`."""

    def __init__(self, name: str, slices: int, n: int, first: int = 0, cost: int = 50, log: list | None = None,
                 poison: bool = False, fail_at: int | None = None):
        self.name, self.slices, self.n, self.first, self.cost = name, slices, n, first, cost
        self.log, self.poison, self.fail_at = log if log is not None else [], poison, fail_at
        self.closed = False

    def prepare(self) -> None:
        self.log.append((self.name, "prepared"))

    def prefill(self):
        try:
            for i in range(self.slices):
                if i == self.fail_at:
                    raise ValueError("bad input")
                self.log.append((self.name, "slice"))
                yield self.cost
        finally:
            self.closed = True
        sequence = Sequence(self.n, poison=self.poison)
        sequence.accept(self.first)
        self.log.append((self.name, "first token"))
        return sequence

    def finish(self, sequence, reason: str) -> str:
        return f"{self.name}:{reason}"


def simulate(works: dict[int, Work], arrivals: dict[int, int], budget: int = BUDGET, layers: int = LAYERS,
             steps: int = 500) -> tuple[dict[int, list], list[Step]]:
    """Rounds of schedule + run, request i arriving (prepared, ready) before round arrivals[i]: what each
    request emitted, and each round's step."""
    emitted = {i: [] for i in works}
    requests, runner, taken = {}, Runner(advance), []
    for round in range(steps):
        for i, at in arrivals.items():
            if at == round:
                works[i].prepare()
                requests[i] = Request(works[i], emitted[i].append, i, "prefill")
        step = schedule(list(requests.values()), budget, layers)
        if not step and round > max(arrivals.values()):
            break
        taken.append(step)
        runner.run(step, requests)
    return emitted, taken


def test_a_short_request_sent_during_a_long_prefill_gets_its_first_token_first():
    """Least attained service, as a rule over state: the long prefill (200 slices) starts first; the short one
    (3 slices) arrives after its first step, runs its whole prefill in the next step, and answers first."""
    log = []
    works = {0: Work("long", 200, 3, log=log), 1: Work("short", 3, 3, first=100, log=log)}
    emitted, steps = simulate(works, {0: 0, 1: 1}, budget=50, layers=4)  # a step: 4 slices of 50
    assert steps[1].prefill[0].request == 1  # the newcomer's first slice is in the next step
    assert log.index(("short", "first token")) < log.index(("long", "first token"))
    assert emitted[1] == [[100], [101], [102], "short:length"]
    assert emitted[0] == [[0], [1], [2], "long:length"]


def test_long_prefills_take_turns_and_each_stream_gets_a_token_every_step():
    works = {0: Work("a", 40, 3), 1: Work("b", 40, 3), 2: Work("s", 0, 30, first=500)}
    _, steps = simulate(works, {0: 0, 1: 0, 2: 0}, budget=50, layers=4)
    turns = [step.prefill[0].request for step in steps if step.prefill]
    assert turns[:7] == [0, 1, 2, 0, 1, 0, 1]  # none served first (in arrival order), then a step each in turn
    assert all(2 in step.decode for step in steps[3:20])  # prefills never hold back the stream's next token
    assert all(len(step.prefill) <= 1 for step in steps)


def test_the_runner_spends_a_slices_work_in_whole_chunks():
    """A slice of 200 token-layers over chunks of 50 runs 4 of them; the first slice of a request whose cost is
    unknown runs one chunk at least."""
    log = []
    request = Request(Work("w", 10, 2, log=log), lambda item: None, 0, "prefill")
    runner = Runner(advance)
    runner.run(Step(prefill=(PrefillSlice(0, 1),)), {0: request})
    assert log.count(("w", "slice")) == 1 and request.served == 50 and request.slice_cost == 50
    runner.run(Step(prefill=(PrefillSlice(0, 200),)), {0: request})
    assert log.count(("w", "slice")) == 5 and request.served == 250 and runner.prefilled == 250


def test_an_error_reaches_only_its_request_and_ended_requests_give_back_their_slot():
    works = {0: Work("a", 2, 5), 1: Work("bad", 4, 5, fail_at=2), 2: Work("p", 1, 5, first=10, poison=True),
             3: Work("b", 2, 4, first=50)}
    emitted, _ = simulate(works, {i: 0 for i in works})
    assert emitted[0] == [[0], [1], [2], [3], [4], "a:length"]
    assert emitted[3] == [[50], [51], [52], [53], "b:length"]
    assert len(emitted[1]) == 1 and isinstance(emitted[1][0], ValueError) and works[1].closed
    assert emitted[2][0] == [10] and isinstance(emitted[2][1], RuntimeError) and len(emitted[2]) == 2


def test_a_halted_request_ends_at_once_stopped_ones_with_their_record_cancelled_without():
    emitted, requests, runner = [], {}, Runner(advance)
    for i, halt in enumerate(("stop", "cancelled")):
        requests[i] = Request(Work(str(i), 0, 100), emitted.append, i, "prefill")
        runner.run(schedule(requests.values(), BUDGET, LAYERS), requests)  # its first token
        requests[i].halt = halt
        runner.run(schedule(requests.values(), BUDGET, LAYERS), requests)
        assert requests[i].phase == "done" and requests[i].sequence.released
    assert emitted == [[0], "0:stop", [0]]


class Output:
    """An output side: a token id as text; a stop once `stop_at` is seen."""

    def __init__(self, stop_at: int | None = None):
        self.stop_at, self.stopped = stop_at, False

    def feed(self, item):
        if isinstance(item, str) or self.stopped:
            return [item] if isinstance(item, str) else []
        self.stopped = self.stop_at in item
        return [f"<{token}>" for token in item]


def test_a_request_alone_runs_through_the_same_schedule_and_runner():
    assert list(run_alone(Work("w", 3, 4, first=7), Output(), advance, LAYERS)) == \
        ["<7>", "<8>", "<9>", "<10>", "w:length"]
    # its output's stop ends it at the next step with its record; the tokens decoded meanwhile are not shown
    assert list(run_alone(Work("w", 0, 50), Output(stop_at=2), advance, LAYERS)) == ["<0>", "<1>", "<2>", "w:stop"]
    with pytest.raises(ValueError, match="bad input"):
        list(run_alone(Work("w", 3, 4, fail_at=1), Output(), advance, LAYERS))


def test_closing_a_run_closes_the_request():
    work = Work("w", 5, 1000)
    run = run_alone(work, Output(), advance, LAYERS)
    assert [next(run) for _ in range(3)] == ["<0>", "<1>", "<2>"]
    run.close()
    assert work.closed


def decoding(max_new_tokens: int, first: int, eos=frozenset({2})) -> Decoding:
    sequence = Decoding(pool=None, slot=0, length=5, sampling=SamplingParams(max_new_tokens), first_token=first,
                        eos_ids=eos)
    sequence.accept(first)
    return sequence


def test_where_a_sequence_ends_is_decided_by_accept():
    sequence = decoding(10, 7)
    for token in (8, 2):
        sequence.accept(token)
    assert sequence.tokens == [7, 8, 2] and sequence.finish_reason == "stop"  # the eos is the last id
    sequence = decoding(3, 7)
    sequence.accept(8)
    assert sequence.finish_reason is None
    sequence.accept(9)
    assert sequence.finish_reason == "length"
    assert decoding(1, 7).finish_reason == "length" and decoding(5, 2).finish_reason == "stop"
