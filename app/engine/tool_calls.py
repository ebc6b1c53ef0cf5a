"""Tool calls out: the grammar a request's tool_choice / response_format asks for, and the calls parsed from the
model's answer.

The form is the one blend.prompt tells the model to use (Hermes): free text, then calls, each
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
Grammars (llguidance's Lark, blend.grammar), each call's JSON its tool's name, then arguments its parameters allow
(each tool's parameters their own `%json` root, so their `$defs`/`$ref`s resolve as in the schema alone):
    auto       free text that never opens a call, optionally followed by calls: the text stays free until the
               model writes `<tool_call>`; from there the call must be a valid call of one of the tools. With
               response_format json_schema: the document of the schema, or calls (nothing before them)
    required   one call or more (at most MAX_PARALLEL_CALLS; one with parallel_tool_calls false), nothing before
    named      one call of that function
    none       free text that never opens a call
    json       (response_format json_object / json_schema) the JSON document alone
Schemas are checked before any compile (SchemaLimitError): MAX_SCHEMA_CHARS of JSON, MAX_SCHEMA_DEPTH levels,
and blend.grammar.refusal (too many string patterns intersected, no finite document). A tool's name may not hold
the call markup.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from blend.grammar import json_rule, refusal

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_SCHEMA_CHARS = 16_000  # a tool's parameters or a response schema, as JSON text
MAX_SCHEMA_DEPTH = 12      # nesting of objects and arrays in one schema
MAX_PARALLEL_CALLS = 4     # calls in one answer (a weak model may otherwise call on until max_tokens)
# free text that never contains `<tool_call>` (llguidance's regex `&` and `~`)
_TEXT = r'TEXT: /(.|\n)*/ & ~/(.|\n)*<tool_call>(.|\n)*/'


class SchemaLimitError(ValueError):
    """A schema or tool refused before any compile: over MAX_SCHEMA_CHARS or MAX_SCHEMA_DEPTH, more than
    MAX_PATTERNS patterns intersected, no finite document, or a tool name holding the call markup."""


@dataclass
class ToolCallOut:
    """A call the model made: its id (unique: `call_...`), function name and arguments as JSON text."""
    id: str
    name: str
    arguments: str


def check_schema(schema: Any, where: str) -> None:
    text = json.dumps(schema)
    if len(text) > MAX_SCHEMA_CHARS:
        raise SchemaLimitError(f"{where}: a schema of {len(text)} characters (at most {MAX_SCHEMA_CHARS})")
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise SchemaLimitError(f"{where}: a schema nested deeper than {MAX_SCHEMA_DEPTH} levels")
    reason = refusal(schema)
    if reason:
        raise SchemaLimitError(f"{where}: {reason}")


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


def check_name(name: str) -> None:
    """A tool's name may not hold the call markup: its calls would not be told from text."""
    if OPEN in name or CLOSE in name:
        raise SchemaLimitError(f"tools: the tool name {name!r} holds the call markup ({OPEN} or {CLOSE})")


def call_rules(tools: list[dict]) -> str:
    """Lark rules: `body`, the JSON of a call to one of `tools` (OpenAI tool dicts), in blend.grammar's JSON_FORM:
    its name, then arguments its parameters allow, each tool's parameters their own %json root."""
    calls, rules = [], []
    for i, tool in enumerate(tools):
        function = tool["function"]
        head = json.dumps('{"name": ' + json.dumps(function["name"], ensure_ascii=False) + ', "arguments": ',
                          ensure_ascii=False)
        calls.append(f"call_{i}")
        rules += [f'call_{i}: {head} args_{i} "}}"', f"args_{i}: {json_rule(function.get('parameters') or {})}"]
    return "body: " + " | ".join(calls) + "\n" + "\n".join(rules) + "\n"


def tools_grammar(tools: list[dict], choice: str | None, parallel: bool = True,
                  answer_schema: dict | None = None) -> str | None:
    """The grammar of an answer with `tools` under `choice`: "auto" | "none" | "required" | a function's name
    (None: no tools, `answer_schema` alone). `answer_schema`: the JSON a non-call answer must be."""
    for tool in tools:
        check_name(tool["function"]["name"])
    answer = f"answer: {json_rule(answer_schema)}\n" if answer_schema is not None else None
    if not tools or choice == "none":
        if answer:
            return "start: answer\n" + answer
        return f"start: TEXT\n{_TEXT}\n" if tools else None
    chosen = [t for t in tools if t["function"]["name"] == choice] if choice not in ("auto", "required") else tools
    for tool in chosen:
        check_schema(tool["function"].get("parameters") or {}, f"tools: {tool['function']['name']}")
    more = _up_to(MAX_PARALLEL_CALLS - 1) if parallel and choice in ("auto", "required") else ""
    rules = f'call: "{OPEN}\\n" body "\\n{CLOSE}"\n' + call_rules(chosen)
    if choice == "auto" and answer:  # the schema's document, or calls: never text
        return f"start: answer | call{more}\n" + rules + answer
    if choice == "auto":  # text until the model opens a call (the lazy opener ends at the first one), then calls
        calls = f'opener "\\n" body "\\n{CLOSE}"{more}'
        return f"start: TEXT | {calls}\n" + rules + f"opener[lazy]: /(.|\\n)*{OPEN}/\n{_TEXT}\n"
    return f"start: call{more}\n" + rules


def _up_to(n: int) -> str:
    """At most `n` more calls, each after a newline: ( "\\n" call ( "\\n" call )? )? ..."""
    return f' ("\\n" call{_up_to(n - 1)})?' if n else ""


def response_schema(response_format: dict | None) -> dict | None:
    """The JSON schema a response_format asks for (json_object: any object); None for text."""
    kind = (response_format or {}).get("type", "text")
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        schema = response_format["json_schema"].get("schema") or {"type": "object"}
        check_schema(schema, "response_format.json_schema.schema")
        return schema
    return None


class CallStream:
    """An answer's text as it arrives, split into content and calls: `feed(delta)` and `finish()` return the
    events ("text", str) and ("call", ToolCallOut) in order. Text that could open a call is held back until it
    cannot; a call is released when closed. A call left open at the end (cut by max_tokens or a stop string) is
    dropped (`cut`): never returned as a call, nor as text. A call identical to an earlier one (name and
    arguments: a small model repeats itself) is dropped too: its tool would answer it the same. `prefill`: the
    answer's start the client wrote (app.engine.query.QueryParams.prefill), read first and not returned: a call
    it opens comes back whole once the answer closes it."""

    def __init__(self, prefill: str = "") -> None:
        self.buffer, self.in_call, self.cut = "", False, False
        self.content: list[str] = []
        self.tool_calls: list[ToolCallOut] = []
        if prefill:
            self.feed(prefill)
            self.content, self.tool_calls = [], []

    def feed(self, delta: str) -> list[tuple[str, Any]]:
        self.buffer += delta
        events: list[tuple[str, Any]] = []
        while True:
            if self.in_call:
                end = self.buffer.find(CLOSE)
                if end < 0:
                    return events
                events += self._call(self.buffer[:end])
                self.buffer, self.in_call = self.buffer[end + len(CLOSE):], False
                continue
            start = self.buffer.find(OPEN)
            if start < 0:
                keep = next((n for n in range(min(len(OPEN) - 1, len(self.buffer)), 0, -1)
                             if self.buffer.endswith(OPEN[:n])), 0)
                text, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                return events + self._text(text)
            events += self._text(self.buffer[:start])
            self.buffer, self.in_call = self.buffer[start + len(OPEN):], True

    def finish(self) -> list[tuple[str, Any]]:
        rest, self.buffer = self.buffer, ""
        if self.in_call:
            self.cut, self.in_call = True, False
            return []
        return self._text(rest)

    def _text(self, text: str) -> list[tuple[str, Any]]:
        if not text or (self.tool_calls and not text.strip()):  # the newlines between calls
            return []
        self.content.append(text)
        return [("text", text)]

    def _call(self, body: str) -> list[tuple[str, Any]]:
        try:
            call = json.loads(body)
            name, arguments = call["name"], call.get("arguments", {})
            if not isinstance(name, str):
                raise TypeError(name)
        except (ValueError, KeyError, TypeError):
            return self._text(OPEN + body + CLOSE)
        arguments = arguments if isinstance(arguments, str) else json.dumps(arguments)
        if any(c.name == name and c.arguments == arguments for c in self.tool_calls):
            return []
        out = ToolCallOut(f"call_{uuid.uuid4().hex[:24]}", name, arguments)
        self.tool_calls.append(out)
        return [("call", out)]


def split_tool_calls(text: str, prefill: str = "") -> tuple[str, list[ToolCallOut]]:
    """A whole answer: its content (the text outside calls, stripped; after a prefill, only at its end: the
    continuation may start with a space) and its calls."""
    stream = CallStream(prefill)
    stream.feed(text)
    stream.finish()
    content = "".join(stream.content)
    return content.rstrip() if prefill else content.strip(), stream.tool_calls


# ---- what both dialects share (OpenAI's chat completions, Anthropic's messages) ----------------------------------

class ToolChoiceError(ValueError):
    """A tool_choice the tools cannot satisfy (the route's 400, naming tool_choice)."""


def choice_grammar(tools: list[dict], choice: str, parallel: bool = True, schema: dict | None = None,
                   said: str | None = None) -> str | None:
    """The answer's grammar under `choice` (auto, none, required, or a tool's name: each dialect's choice in these
    words), checked first against the tools: ToolChoiceError for a name not among them or a call forced with no
    tools (`said`: the client's word for the choice, for the message); SchemaLimitError from the schemas."""
    names = [t["function"]["name"] for t in tools]
    if choice not in ("auto", "none", "required") and choice not in names:
        raise ToolChoiceError(f"tool_choice: {choice!r} is not among the tools ({', '.join(names) or 'none'})")
    if choice != "auto" and choice != "none" and not tools:
        raise ToolChoiceError(f"tool_choice {said or choice} needs tools")
    return tools_grammar(tools, choice, parallel, schema)


async def answer_parts(events: AsyncIterator[Any], calls: bool, prefill: str = "") -> AsyncIterator[tuple[str, Any]]:
    """A streamed answer (its text deltas, then its result) as ("text", str) and, with `calls` (tools),
    ("call", ToolCallOut) pieces in order (CallStream, after the `prefill`), then ("end", result)."""
    split = CallStream(prefill)
    async for event in events:
        if isinstance(event, str):
            for part in split.feed(event) if calls else [("text", event)]:
                yield part
            continue
        for part in split.finish() if calls else []:
            yield part
        yield "end", event


def fragments(text: str, size: int = 16) -> list[str]:
    """A call's arguments in the pieces a stream sends them in (at least one, maybe empty)."""
    return [text[i:i + size] for i in range(0, len(text), size)] or [""]
