"""Anthropic's Messages API, POST /v1/messages, over the chat endpoint's engine; POST /v1/messages/count_tokens
counts the prompt a Messages body would run (the engine's own plan of it, nothing computed). `model` is one of the
ids GET /v1/models lists (another is a 404 not_found_error).

A request becomes the same engine request /v1/chat/completions builds: `tools` and `system` form the system
turn (so the prompt head), every message an earlier turn (tool_use and tool_result blocks as text) but the last
user message, the question. An assistant's message last is a prefill, as Anthropic's: the assistant turn rendered
open with it (blend.prompt), the model continues it, and `content` holds the continuation alone; under tools or a
grammar its tokens are the answer's start (a prefill the grammar refuses is a 400), and a call it opens comes back
whole as a tool_use block. Retrieval is off unless the request sets the ragblend extra
`retrieval: true` (then `retrieval_top_k` passages, as `top_k` on the chat endpoint). Anthropic's own `top_k` is a
sampling parameter: accepted and ignored (ragblend samples with temperature and top_p), never the passages.

Prompt caching. ragblend stores every piece of every prompt anyway (the head, each exchange: blend.prompt);
a `cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}` breakpoint (on a tool, a system block or a
message's block, or the request's own for its last block; any number) leases the prefix up to it for its ttl
(app.engine.prompt_cache): the head for one on a tool or the system, the head and the exchanges through that
message for one on a message (on the last message: the whole prompt, passages too). Leases go to the family
`anthropic:<metadata.user_id>` (`anthropic` without one). Usage counts each prompt token once:
- `cache_read_input_tokens`: tokens whose KV was read from the store;
- `cache_creation_input_tokens`: tokens whose KV this request computed and stored under a breakpoint
  (`cache_creation` splits them by ttl);
- `input_tokens`: the rest (the question and template tokens, pieces computed outside any breakpoint).
A lease the store refuses (a tier's pinned cap) leaves the answer as it is: the header
`x-ragblend-lease: refused` and the ragblend extra `lease` on the message (streamed: on message_delta).

Streaming follows Anthropic's events: message_start, content_block_start, ping, content_block_delta (text),
content_block_stop, message_delta (stop reason and the whole usage: the prompt's figures are known only at
the end, so message_start's usage says 0 input tokens), message_stop; a failure after the start is an
`error` event. Errors are Anthropic's ({"type": "error", "error": {"type", "message"}}, app/api/errors.py), and
`x-api-key` is accepted where `server.api_key` is set; `anthropic-version` is not checked.
Not supported (a 400): image, document and thinking blocks.
Tools are rendered as the chat endpoint renders them (blend.prompt), and the model's calls come back as tool_use
blocks (`stop_reason` tool_use; streamed as input_json_delta) after any text; `tool_choice` is enforced by
grammar-constrained decoding (app.engine.tool_calls). `stop_reason`: end_turn, max_tokens, stop_sequence (with
`stop_sequence`) or tool_use.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sse_starlette import ServerSentEvent

from app.api.deps import service
from app.api.errors import REFUSALS, ApiError, as_api_error, located, rule_of
from app.api.query_routes import QueryRun, check_model, sse
from app.api.schemas.anthropic import (
    ERRORS,
    CacheControl,
    CacheCreation,
    CountTokensRequest,
    Message,
    MessageOut,
    MessagesRequest,
    MessageUsage,
    TextBlock,
    TextOut,
    TokenCount,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
    ToolUseOut,
)
from app.api.schemas.ragblend import MAX_SEED, check_budget, check_limits
from app.config import LimitsSettings
from app.engine.prompt_cache import LeaseNote, lease, lease_headers, prefix_keys
from app.engine.query import KeyUse, QueryParams, QueryResult
from app.engine.tool_calls import (
    CLOSE,
    OPEN,
    SchemaLimitError,
    ToolCallOut,
    ToolChoiceError,
    answer_parts,
    choice_grammar,
    fragments,
)
from app.serving.service import Service
from blend.prompt import hermes_tools

router = APIRouter()
TTL_S = {"5m": 300.0, "1h": 3600.0}
STOP_REASONS = {"length": "max_tokens"}  # else end_turn


# The body's schema, read by the route itself (for Anthropic's errors): its parts go into the OpenAPI
# components as Anthropic<Name> (`describe`), clear of the OpenAI models' names.
BODY_SCHEMA = MessagesRequest.model_json_schema(ref_template="#/components/schemas/Anthropic{model}")
BODY_PARTS = {f"Anthropic{name}": part for name, part in BODY_SCHEMA.pop("$defs").items()}
COUNT_SCHEMA = CountTokensRequest.model_json_schema(ref_template="#/components/schemas/Anthropic{model}")
COUNT_SCHEMA.pop("$defs")


def describe(openapi: dict[str, Any], limits: LimitsSettings) -> None:
    """The body's parts, and this server's limits in the body's description (as
    app.api.schemas.ragblend.state_limits)."""
    openapi["components"]["schemas"].update(BODY_PARTS)
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        schema = openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        limited = [("retrieval_top_k", limits.max_top_k), ("seed", MAX_SEED)]
        for name, maximum in limited:  # (the seed exactly: not as a float)
            next(s for s in schema["properties"][name]["anyOf"] if s.get("type") == "integer")["maximum"] = maximum
        schema["properties"]["messages"]["description"] += (
            f" The question has at most {limits.max_question_chars} characters (limits.max_question_chars); at "
            f"most {limits.max_message_tokens} tokens a message and {limits.max_prompt_tokens} in the whole prompt; "
            f"the body at most {limits.max_body_bytes} bytes (limits.max_body_bytes).")
    openapi["paths"]["/v1/messages"]["post"]["requestBody"]["content"]["application/json"]["schema"][
        "properties"]["max_tokens"]["maximum"] = limits.max_new_tokens


# ---- the request, as the engine's ----------------------------------------------------------------

def block_text(block: TextBlock | ToolUseBlock | ToolResultBlock) -> str:
    """A block as the model reads it."""
    match block:
        case TextBlock():
            return block.text
        case ToolUseBlock():
            return f"{OPEN}\n{json.dumps({'name': block.name, 'arguments': block.input})}\n{CLOSE}"  # (Hermes)
        case ToolResultBlock():
            content = block.content if isinstance(block.content, str) else "\n".join(b.text for b in block.content)
            return f"[tool result {block.tool_use_id}{' (error)' if block.is_error else ''}: {content}]"


def message_text(message: Message) -> str:
    return message.content if isinstance(message.content, str) else "\n".join(map(block_text, message.content))


def system_text(body: CountTokensRequest) -> str | None:
    """The tools (in the Hermes form the calls are parsed from: blend.prompt.hermes_tools) and the system
    blocks: the system turn."""
    system = body.system if isinstance(body.system, str) or body.system is None else \
        "\n".join(b.text for b in body.system)
    parts = ([hermes_tools(openai_tools(body))] if body.tools else []) + ([system] if system else [])
    return "\n\n".join(parts) or None


def openai_tools(body: CountTokensRequest) -> list[dict]:
    """The tools as the engine takes them (OpenAI's form): the prompt tells the model how to call them."""
    return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                              "parameters": t.input_schema or {"type": "object"}}}
            for t in body.tools]


def tool_grammar(body: CountTokensRequest, tools: list[dict]) -> str | None:
    """The answer's grammar under tool_choice (app.engine.tool_calls); a 400 for a choice it cannot follow."""
    choice = body.tool_choice or ToolChoice(type="auto")
    name = choice.name if choice.type == "tool" else {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    try:
        return choice_grammar(tools, name, parallel=not choice.disable_parallel_tool_use, said=choice.type)
    except ToolChoiceError as exc:
        raise ApiError(400, str(exc), param="tool_choice") from None
    except SchemaLimitError as exc:
        raise ApiError(400, str(exc)) from None


def breakpoints(body: CountTokensRequest) -> list[tuple[int | None, float]]:
    """(message index or None for tools and system, ttl_s) of each cache_control, as many as the request has: the
    store's leases are capped per tenant in bytes (app.engine.prompt_cache), so a count would protect nothing."""
    found: list[tuple[int | None, CacheControl]] = []
    system = body.system if isinstance(body.system, list) else []
    found += [(None, b.cache_control) for b in (*body.tools, *system) if b.cache_control]
    for i, message in enumerate(body.messages):
        if isinstance(message.content, list):
            for block in message.content:
                found += [(i, c) for c in _controls(block)]
    found += [(len(body.messages) - 1, body.cache_control)] if body.cache_control else []
    return [(i, TTL_S[c.ttl]) for i, c in found]


def _controls(block: TextBlock | ToolUseBlock | ToolResultBlock) -> list[CacheControl]:
    inner = block.content if isinstance(block, ToolResultBlock) and isinstance(block.content, list) else []
    return [b.cache_control for b in (block, *inner) if b.cache_control]


def parse(raw: bytes, model: type[CountTokensRequest] = MessagesRequest) -> Any:
    try:
        body = model.model_validate_json(raw)
    except ValidationError as exc:
        raise ApiError(400, _invalid(exc.errors(include_url=False))) from None
    return body


def _invalid(errors: list[dict[str, Any]]) -> str:
    """Pydantic's errors as Anthropic words them ("messages.0.content.0.cache_control.ttl: Input should be ...");
    of a union's branches, the one that got deepest (a list of blocks, rather than "should be a string")."""
    if errors and errors[0]["type"] == "json_invalid":
        return f"body: invalid JSON ({errors[0].get('ctx', {}).get('error', errors[0]['msg'])})"
    return "; ".join(f"{where}: {why}" for where, why in located([{**e, "loc": _where(e)} for e in errors], _rule))


def _rule(error: dict[str, Any]) -> str:
    """One error's rule, in words: a content block or `thinking` this server does not take says so."""
    if error["type"] == "union_tag_invalid" and "content" in error["loc"]:
        return f"{error['ctx']['tag']} blocks are not supported (this server takes text, tool_use and tool_result)"
    if error["loc"][:1] == ("thinking",):
        return "extended thinking is not supported (leave `thinking` out, or send {\"type\": \"disabled\"})"
    return rule_of(error)


def _where(error: dict[str, Any]) -> tuple[Any, ...]:
    return ("thinking",) if error["loc"][:1] == ("thinking",) else error["loc"]


# ---- the route -------------------------------------------------------------------------------------

@router.post("/v1/messages", response_model=MessageOut, openapi_extra={
                 "requestBody": {"required": True, "content": {"application/json": {"schema": BODY_SCHEMA}}}},
             responses={200: {"content": {"text/event-stream": {}}, "description": "JSON, or Anthropic's events "
                                                                                 "with stream: true"}, **ERRORS})
async def messages(request: Request, svc: Service = Depends(service)):
    """Anthropic's Messages API (see the module docstring)."""
    body = parse(await request.body())
    marks = breakpoints(body)
    params = replace(await engine_params(body, svc, body.max_tokens), temperature=body.temperature or 0.0,
                     top_p=body.top_p or 1.0, stop=tuple(s for s in body.stop_sequences if s), seed=body.seed)
    run = await QueryRun.start(svc, params, request, "messages")
    head = {"id": f"msg_{uuid.uuid4().hex}", "model": body.model}
    family = f"anthropic:{body.metadata.user_id}" if body.metadata and body.metadata.user_id else "anthropic"
    last = len(body.messages) - 1

    async def retain(result: QueryResult) -> LeaseNote | None:
        return await svc.blocking("store", lease, svc.serving.store, family,
                                  [(_prefix(result.kv_keys, at, last), ttl) for at, ttl in marks])

    if body.stream:
        return sse(run, events(run, head, marks, last, retain, params.tool_calls, params.prefill))
    result = await run.result(request)
    note = await retain(result)
    out = MessageOut(**head, content=content_blocks(result), stop_reason=_stop_reason(result),
                     stop_sequence=result.stop_sequence,
                     usage=usage(result, marks, last), lease=note)
    return JSONResponse(out.model_dump(exclude=set() if note else {"lease"}), headers=lease_headers(note))


@router.post("/v1/messages/count_tokens", response_model=TokenCount, openapi_extra={
                 "requestBody": {"required": True, "content": {"application/json": {"schema": COUNT_SCHEMA}}}},
             responses=ERRORS)
async def count_tokens(request: Request, svc: Service = Depends(service)) -> TokenCount:
    """Anthropic's token counting: the prompt /v1/messages would run for the same body (chat template, system,
    tools, passages with retrieval), laid out by the engine's own plan (nothing computed)."""
    body = parse(await request.body(), CountTokensRequest)
    breakpoints(body)  # the same 400s as /v1/messages
    params = await engine_params(body, svc, 1)
    plan = await svc.lookup(params)
    return TokenCount(input_tokens=plan.prompt_tokens)


async def engine_params(body: CountTokensRequest, svc: Service, max_tokens: int) -> QueryParams:
    """The engine request of a Messages body (sampling left at its defaults), its model and limits checked."""
    check_model(svc, body.model)
    texts = [message_text(m) for m in body.messages]
    system, tools = system_text(body), openai_tools(body)
    grammar = tool_grammar(body, tools)
    # the question's limit is on what the user writes, and only with retrieval (without it a message may carry
    # documents: the token budget alone); a tool result counts against the budgets, as an OpenAI tool message does
    q = next((i for i in reversed(range(len(body.messages))) if body.messages[i].role == "user"), -1)
    check_limits(svc.settings.limits, question=question_text(body.messages[q]) if body.retrieval else "",
                 top_k=body.retrieval_top_k, question_field="messages", max_tokens={"max_tokens": max_tokens})
    fields = [*([("system", system)] if system else []), *((f"messages.{i}", t) for i, t in enumerate(texts))]
    await svc.blocking("lookup", check_budget, svc.settings.limits, fields, svc.count_tokens, "messages")
    return svc.query_params(texts[q], top_k=body.retrieval_top_k, max_tokens=max_tokens,
                            # each message a piece, indexed as in body.messages (the system text, which joins the
                            # head wherever it stands, goes last so the indices stay the client's)
                            messages=tuple({"role": m.role, "content": t} for m, t in zip(body.messages, texts))
                            + (({"role": "system", "content": system},) if system else ()),
                            grammar=grammar,
                            tool_calls=bool(tools) and getattr(body.tool_choice, "type", "auto") != "none",
                            retrieve=body.retrieval, continue_final=body.messages[-1].role == "assistant")


def _prefix(uses: Sequence[KeyUse], at: int | None, last: int) -> list[str]:
    """The keys a breakpoint at message `at` (None: tools or system) covers; at the last message, all."""
    return [u.key for u in uses] if at == last else prefix_keys(uses, at)


def usage(result: QueryResult, marks: list[tuple[int | None, float]], last: int) -> MessageUsage:
    """Each prompt token once: read from the store, computed under a breakpoint (by its longest ttl), or input."""
    s, uses = result.stats, result.kv_keys
    read = s.cached_tokens  # read from the store and not recomputed (app.engine.planner)
    ttl_of: dict[str, float] = {}
    for at, ttl in marks:
        for key in _prefix(uses, at, last):
            ttl_of[key] = max(ttl, ttl_of.get(key, 0.0))
    created = {ttl: sum(u.tokens for u in uses if not u.cached and ttl_of.get(u.key) == ttl) for ttl in TTL_S.values()}
    creation = sum(created.values())
    return MessageUsage(input_tokens=max(0, s.prompt_tokens - read - creation), cache_read_input_tokens=read,
                        cache_creation_input_tokens=creation,
                        cache_creation=CacheCreation(ephemeral_5m_input_tokens=created[TTL_S["5m"]],
                                                     ephemeral_1h_input_tokens=created[TTL_S["1h"]]),
                        output_tokens=s.completion_tokens)


def question_text(message: Message) -> str:
    """What the user wrote in a message: its text blocks."""
    if isinstance(message.content, str):
        return message.content
    return "\n".join(b.text for b in message.content if isinstance(b, TextBlock))


def content_blocks(result: QueryResult) -> list[TextOut | ToolUseOut]:
    """The answer's text (if any, or if there are no calls) and its calls as tool_use blocks."""
    calls = [ToolUseOut(id=_tool_use_id(c), name=c.name, input=json.loads(c.arguments)) for c in result.tool_calls]
    return ([TextOut(text=result.answer)] if result.answer or not calls else []) + calls


def _tool_use_id(call: ToolCallOut) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def _stop_reason(result: QueryResult) -> str:
    if result.tool_calls and result.finish_reason != "length":  # cut by max_tokens: "max_tokens", calls or not
        return "tool_use"
    if result.stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS.get(result.finish_reason, "end_turn")


async def events(run: QueryRun, head: dict[str, Any], marks: list[tuple[int | None, float]], last: int,
                 retain: Callable[[QueryResult], Awaitable[LeaseNote | None]], calls: bool = False, prefill: str = ""
                 ) -> AsyncIterator[ServerSentEvent]:
    """Anthropic's event stream; a failure once it has begun is an `error` event. The text block opens at the
    first text; with `calls` (tools) each call is a tool_use block, its input streamed as input_json_delta (a
    call the `prefill` opened, whole)."""
    def event(kind: str, **data: Any) -> ServerSentEvent:
        return ServerSentEvent(json.dumps({"type": kind, **data}), event=kind)

    blocks: list[str] = []  # the kinds of the blocks opened, the last one still open

    def open_block(kind: str, block: dict[str, Any]) -> list[ServerSentEvent]:
        out = [event("content_block_stop", index=len(blocks) - 1)] if blocks else []
        blocks.append(kind)
        return out + [event("content_block_start", index=len(blocks) - 1, content_block=block)]

    def deltas(kind: str, value: Any) -> list[ServerSentEvent]:
        if kind == "text":
            out = open_block("text", {"type": "text", "text": ""}) if not blocks or blocks[-1] != "text" else []
            return out + [event("content_block_delta", index=len(blocks) - 1,
                                delta={"type": "text_delta", "text": value})]
        out = open_block("tool_use", {"type": "tool_use", "id": _tool_use_id(value), "name": value.name, "input": {}})
        return out + [event("content_block_delta", index=len(blocks) - 1,
                            delta={"type": "input_json_delta", "partial_json": fragment})
                      for fragment in fragments(value.arguments) if fragment]

    start = MessageOut(**head, content=[], stop_reason=None, usage=MessageUsage(
        input_tokens=0, cache_creation_input_tokens=0, cache_read_input_tokens=0, output_tokens=0,
        cache_creation=CacheCreation(ephemeral_5m_input_tokens=0, ephemeral_1h_input_tokens=0)))
    try:
        yield event("message_start", message=start.model_dump(exclude={"lease"}))
        yield event("ping")
        async for kind, item in answer_parts(run.events(), calls, prefill):
            if kind != "end":
                for sent in deltas(kind, item):
                    yield sent
                continue
            if not blocks:  # no text at all: one empty text block, as before
                for sent in open_block("text", {"type": "text", "text": ""}):
                    yield sent
            note = await retain(item)
            yield event("content_block_stop", index=len(blocks) - 1)
            delta = {"stop_reason": _stop_reason(item), "stop_sequence": item.stop_sequence}
            yield event("message_delta", delta=delta, usage=usage(item, marks, last).model_dump(),
                        **({"lease": note.model_dump()} if note else {}))
            yield event("message_stop")
    except Exception as exc:
        REFUSALS.log(run.path, error := as_api_error(exc))
        yield event("error", error=error.anthropic_body()["error"])
