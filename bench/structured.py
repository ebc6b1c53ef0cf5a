"""Structured answers: validity under grammar-constrained decoding, its cost per token, and schema compile time.

    python bench/structured.py [--n 50] [--steps 24] [--repeats 3]

On the embedded SmolLM2, in process (the engine's own request program, chat without retrieval; answers run
four at a time through blend.driver's schedule and runner, as the scheduler batches them):
- validity: `--n` answers per case (tool_choice required, a named function, response_format json_schema), at
  temperature 0 and 0.7 (each answer its own question and seed): the calls' arguments checked with jsonschema
  against the tool's parameters, the json_schema answers against their schema;
- decode cost: DecodeRuntime.step at batch 1 and 4, every row constrained vs none (the same prompt and steps,
  interleaved, median of `--repeats`): ms per token and the ratio;
- compile time: each case's grammar compiled cold and again (cached: a copy of the compiled matcher).
Prints JSON with the commit and the load average. Targets (issue 47): 100% valid; <= 10% more per token at
batch 1 and 4; a cached schema <= 5 ms.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jsonschema

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from app.components import Components  # noqa: E402
from app.config import load_settings  # noqa: E402
from app.engine.query import QueryParams, QueryResult  # noqa: E402
from app.engine.rag_engine import RagEngine  # noqa: E402
from app.engine.tool_calls import tools_grammar  # noqa: E402
from blend import SamplingParams  # noqa: E402
from blend.driver import Request, Runner, schedule  # noqa: E402
from blend.grammar import Grammars, token_masks  # noqa: E402
from common import git_commit  # noqa: E402

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"enum": ["celsius", "fahrenheit"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 14}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}},
        "required": ["timezone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The local time in a timezone.",
                                           "parameters": TIME}}]
ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 60},
                                           "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 15},
                                                    "maxItems": 3}},
          "required": ["answer", "confidence"], "additionalProperties": False}
CITIES = ["Paris", "Oslo", "Lima", "Tokyo", "Cairo", "Quito", "Perth", "Accra", "Riga", "Hanoi"]
CASES = {  # name: (grammar, what a valid answer is checked against)
    "required": (tools_grammar(TOOLS, "required"), "calls"),
    "named": (tools_grammar(TOOLS, "get_weather"), "calls"),
    "json_schema": (tools_grammar([], None, answer_schema=ANSWER), "document"),
}


def log(message: str) -> None:
    print(f"[bench/structured] {message}", file=sys.stderr, flush=True)


def question(i: int) -> str:
    city = CITIES[i % len(CITIES)]
    return [f"What will the weather be in {city} for the next {i % 7 + 1} days?",
            f"Is it raining in {city} right now, and what time is it there?",
            f"Tell me about {city}: its weather and its time zone."][i % 3]


def answers(engine: RagEngine, case: str, temperature: float, n: int) -> list[QueryResult | Exception]:
    """`n` answers of a case, four at a time through one runner."""
    grammar, _ = CASES[case]
    out: list[QueryResult | Exception] = []
    for start in range(0, n, 4):
        requests, results, runner = {}, [], Runner(engine.parts.runtime.advance)
        for i in range(start, min(n, start + 4)):
            params = QueryParams(question(i), messages=({"role": "user", "content": question(i)},),
                                 tools=tuple(TOOLS) if case != "json_schema" else (), retrieve=False, mode="full",
                                 max_tokens=160, temperature=temperature, seed=i, grammar=grammar,
                                 tool_calls=case != "json_schema")
            box: list = []
            results.append(box)
            work, output = engine.request(params), engine.output(params)

            def emit(item, output=output, box=box) -> None:
                box.extend([item] if isinstance(item, BaseException) else output.feed(item))
            try:
                work.prepare()  # (off the model thread in the server)
            except Exception as exc:  # noqa: BLE001 - this answer's error
                box.append(exc)
                continue
            requests[i] = Request(work, emit, i, "prefill")
        while any(r.phase != "done" for r in requests.values()):  # the server's steps, four requests at a time
            runner.run(schedule(requests.values(), engine.settings.server.step_token_budget,
                                engine.parts.blender.num_layers), requests)
        out += [next((e for e in box if isinstance(e, (QueryResult, Exception))), RuntimeError("no result"))
                for box in results]
    return out


def valid(result: QueryResult | Exception, kind: str) -> bool:
    if isinstance(result, Exception) or result.finish_reason == "length":
        return False
    try:
        if kind == "document":
            jsonschema.validate(json.loads(result.answer), ANSWER)
            return True
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        for call in result.tool_calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        return bool(result.tool_calls)
    except (ValueError, jsonschema.ValidationError, KeyError):
        return False


def step_cost(engine: RagEngine, grammar: str | None, batch: int, steps: int) -> tuple[float, float]:
    """ms per token of `steps` DecodeRuntime.steps over `batch` rows, each constrained by `grammar` or not; and
    ms per step of building the rows' mask alone (token_masks, as the step does: timed apart, a load-robust
    part of the difference)."""
    runtime, parts = engine.parts.runtime, engine.parts
    prefill = parts.blender.full_prefill(parts.tokenizer(question(0))["input_ids"] * 8)
    constraint = (lambda: parts.grammars.constraint(grammar)) if grammar else (lambda: None)
    sampling = SamplingParams(max_new_tokens=steps + 1, temperature=0.7, seed=1)
    rows = [runtime.start(prefill, sampling, constraint()) for _ in range(batch)]
    try:
        tokens, elapsed, masking = [r.first_token for r in rows], 0.0, 0.0
        for _ in range(steps):
            for r, token in zip(rows, tokens):  # the decode loop's part: the grammar takes each token
                if r.constraint is not None:
                    r.constraint.advance(token)
                    if r.constraint.finished:  # done: a new answer's grammar (the cost stays that of a grammar)
                        r.constraint = constraint()
            t = time.perf_counter()
            token_masks([r.constraint for r in rows], runtime.vocab)
            masking += time.perf_counter() - t
            t = time.perf_counter()
            tokens = runtime.step(rows, tokens, [r.length for r in rows])
            elapsed += time.perf_counter() - t
        return elapsed * 1000 / (steps * batch), masking * 1000 / steps
    finally:
        for r in rows:
            r.release()


def compile_times(engine: RagEngine) -> dict:
    grammars = Grammars(engine.parts.tokenizer, engine.parts.runtime.vocab)
    t = time.perf_counter()
    grammars.start()  # llguidance's form of the tokenizer and the compile processes (once per server)
    grammars.constraint("start: /[a-z]+/")
    out = {"tokenizer_ms": round((time.perf_counter() - t) * 1000, 1)}
    for case, (grammar, _) in {**CASES, "auto": (tools_grammar(TOOLS, "auto"), None)}.items():
        t = time.perf_counter()
        grammars.constraint(grammar)
        cold = (time.perf_counter() - t) * 1000
        t = time.perf_counter()
        for _ in range(100):
            grammars.constraint(grammar)
        out[case] = {"cold_ms": round(cold, 2), "cached_ms": round((time.perf_counter() - t) * 10, 4)}
    grammars.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=50, help="answers per case and temperature")
    parser.add_argument("--steps", type=int, default=24, help="decode steps per timing")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        settings = load_settings(data_dir=tmp, model={"cache_dir": str(REPO / "data/models")})
        engine = RagEngine(settings, Components(settings))
        report: dict = {"commit": git_commit(), "n": args.n, "compile": compile_times(engine)}
        costs: dict = {}
        for batch in (1, 4):
            runs: dict[str, list[float]] = {"free": [], "constrained": [], "mask": []}
            step_cost(engine, CASES["json_schema"][0], batch, 4)  # warm-up
            for _ in range(args.repeats):  # interleaved: load drifts hit both alike
                runs["free"].append(step_cost(engine, None, batch, args.steps)[0])
                bound, mask = step_cost(engine, CASES["json_schema"][0], batch, args.steps)
                runs["constrained"].append(bound)
                runs["mask"].append(mask)
            free, bound = statistics.median(runs["free"]), statistics.median(runs["constrained"])
            mask = statistics.median(runs["mask"])
            costs[f"batch_{batch}"] = {"free_ms_per_token": round(free, 3),
                                       "constrained_ms_per_token": round(bound, 3),
                                       "ratio": round(bound / free, 3), "mask_ms_per_step": round(mask, 3),
                                       "mask_share_of_free_step": round(mask / (free * batch), 3),
                                       "runs": {k: [round(x, 2) for x in v] for k, v in runs.items()}}
            log(f"batch {batch}: {costs[f'batch_{batch}']}")
        report["decode"] = costs
        validity: dict = {}
        for case, (_, kind) in CASES.items():
            for temperature in (0.0, 0.7):
                t = time.perf_counter()
                results = answers(engine, case, temperature, args.n)
                ok = sum(valid(r, kind) for r in results)
                failures = [repr(r) if isinstance(r, Exception) else r.answer[:120] for r in results
                            if not valid(r, kind)][:3]
                validity[f"{case}@{temperature}"] = {"valid": ok, "of": len(results), "s": round(
                    time.perf_counter() - t, 1), **({"failures": failures} if failures else {})}
                log(f"{case} at {temperature}: {ok}/{len(results)}")
        report["validity"] = validity
        engine.parts.close()
    report["loadavg_before"] = [round(x, 2) for x in load_before]
    report["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
