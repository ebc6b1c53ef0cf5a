"""The query routes: ragblend's own /v1/query and OpenAI-compatible /v1/chat/completions (and /v1/models: a model
id it does not list is a 404 model_not_found), JSON or server-sent events. Both run as a QueryRun: one request in a
slot on the model thread (app.api.openai_completions' /v1/completions too)."""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import APIRouter, Depends, Request, Response
from sse_starlette import EventSourceResponse, ServerSentEvent

from app.api.deps import service, until_done
from app.api.errors import REFUSALS, ApiError, ClientGone, as_api_error
from app.api.schemas.openai import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessageOut,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    Delta,
    FunctionCall,
    ModelCard,
    ModelList,
    NamedToolChoice,
    PromptTokensDetails,
    TokenLogprobOut,
    ToolCall,
    TopLogprob,
    Usage,
)
from app.api.schemas.ragblend import (
    ERRORS,
    MODEL_NOT_FOUND,
    LimitError,
    QueryRequest,
    QueryResponse,
    check_budget,
    check_limits,
)
from app.engine.conversation import Conversation
from app.engine.prompt_cache import DEFAULT_FAMILY, RETENTION_TTL_S, LeaseNote, lease, lease_headers
from app.engine.query import QueryParams, QueryResult
from app.engine.tool_calls import (
    SchemaLimitError,
    ToolChoiceError,
    answer_parts,
    choice_grammar,
    fragments,
    response_schema,
)
from app.serving.service import STOP_MARGIN_S, Service
from app.serving.worker import Job, WorkerStopped
from retrieval import embedder_name

router = APIRouter()
SSE = {"content": {"text/event-stream": {}}, "description": "JSON, or server-sent events with stream: true"}


class QueryRun:
    """One query in a slot on the model thread. `start` waits for its first event, so that errors raised
    before any text (a prompt over the context, say) are still plain HTTP errors rather than broken
    streams; a client that leaves before then cancels it."""

    def __init__(self, svc: Service, job: Job, first: str | QueryResult, rest: AsyncIterator[str | QueryResult],
                 path: str = ""):
        self.svc, self.job, self._first, self._rest, self.path = svc, job, first, rest, path
        self.answered = False  # the result is out

    @classmethod
    async def start(cls, svc: Service, params: QueryParams, request: Request, kind: str) -> QueryRun:
        job = await svc.submit_query(params, kind)
        events = aiter(job)
        try:
            return cls(svc, job, await until_done(request, job, anext(events)), events, request.url.path)
        except StopAsyncIteration:  # ended before its first event: cancelled
            raise WorkerStopped if svc.stopping is not None else ClientGone from None
        except BaseException:
            job.cancel()
            raise

    async def events(self) -> AsyncIterator[str | QueryResult]:
        """Text deltas, then the QueryResult (recorded in the metrics): the job's token ids as its output
        (the engine's QueryOutput) turns them into text, here on the event loop."""
        try:
            async for event in self._all():
                if isinstance(event, QueryResult):
                    if event.finish_reason == "cancelled":
                        break  # cut short: never passed off as a whole answer
                    self.answered = True
                    yield event
                    self.svc.metrics.observe_query(event.stats, self.job.queue_s)
                    return
                yield event
        finally:
            self.cancel()
        # Ended without a result: cancelled (the client left, or the server is stopping).
        raise WorkerStopped if self.svc.stopping is not None else ClientGone

    async def _all(self) -> AsyncIterator[str | QueryResult]:
        yield self._first
        async for event in self._rest:
            yield event

    async def result(self, request: Request) -> QueryResult:
        """The QueryResult (non-streaming); a client that leaves meanwhile cancels the query."""
        async def last() -> QueryResult:
            return [event async for event in self.events()][-1]
        return await until_done(request, self.job, last())

    def cancel(self) -> None:
        """Stop the generation (a no-op once it is done, or answered: what it stores after is for the next
        request, and the scheduler's shutdown still ends it)."""
        if not self.answered:
            self.job.cancel()

    def response(self, result: QueryResult) -> QueryResponse:
        result.stats.queue_ms = round(self.job.queue_s * 1000, 2)
        return QueryResponse(answer=result.answer, sources=result.sources, stats=result.stats,
                             finish_reason=result.finish_reason, explain=result.explain)


def sse(run: QueryRun, events: AsyncIterator[ServerSentEvent]) -> EventSourceResponse:
    """Server-sent events; a client that goes away cancels the run, which stops its generation.

    At shutdown the stream runs on: it ends with its final event within `server.shutdown_grace_s`, or the
    scheduler cancels it then and it ends with a `shutting_down` error event. sse_starlette would cut it
    at once (its default grace is 0); ours outlasts the scheduler's by half the stop margin, and stays
    inside uvicorn's (run_server)."""
    async def guarded() -> AsyncIterator[ServerSentEvent]:
        ended = False
        try:
            async for event in events:
                yield event
            ended = True
        except Exception as exc:  # the headers are out: report in-band, as OpenAI does
            ended = True
            REFUSALS.log(run.path, error := as_api_error(exc))
            yield ServerSentEvent(json.dumps(error.body()), event="error")
        finally:
            run.cancel()
            if not ended:  # the client went away mid-stream (sse_starlette ended the stream)
                REFUSALS.log(run.path, as_api_error(ClientGone()))
    grace = run.svc.settings.server.shutdown_grace_s + STOP_MARGIN_S / 2
    return EventSourceResponse(guarded(), headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                               shutdown_grace_period=grace)


NO_RETRIEVAL = "-chat"  # a served name with this suffix: the chat model without retrieval


def served_models(name: str) -> list[str]:
    """The model ids this server answers to: the model with retrieval, and `<model>-chat` without."""
    return [name, name + NO_RETRIEVAL]


def check_model(svc: Service, model: str | None) -> None:
    """A 404 model_not_found (as OpenAI answers; Anthropic's not_found_error on /v1/messages) for an id GET
    /v1/models does not list; no model at all is the served one."""
    if model is not None and model not in served_models(svc.model_name):
        what = "is the embedder (POST /v1/embeddings)" if model == embedder_name(svc.settings.embedder) else \
            "does not exist"
        raise ApiError(404, f"The model {model!r} {what}: this server answers with "
                            f"{' and '.join(served_models(svc.model_name))} (GET /v1/models)",
                       code="model_not_found", param="model")


@router.get("/v1/models", response_model=ModelList, responses=ERRORS)
def models(svc: Service = Depends(service)) -> ModelList:
    """The model with retrieval (RAG over the documents) and, named `<model>-chat`, without (a plain chat model
    whose messages' KV is reused wherever it reappears): a client picks one by `model`. Last, the embedder
    (POST /v1/embeddings)."""
    names = [*served_models(svc.model_name), embedder_name(svc.settings.embedder)]
    return ModelList(data=[ModelCard(id=name, created=svc.created) for name in names])


@router.post("/v1/query", response_model=QueryResponse, responses={200: SSE, **ERRORS})
async def query(body: QueryRequest, request: Request, svc: Service = Depends(service)):
    check_limits(svc.settings.limits, question=body.question, top_k=body.top_k,
                 max_tokens={"max_tokens": body.max_tokens})
    await svc.blocking("lookup", check_budget, svc.settings.limits, [("question", body.question)], svc.count_tokens,
                            "question")
    params = svc.query_params(body.question, top_k=body.top_k, mode=body.mode, ratio=body.recompute_ratio,
                              selection=body.selection, max_tokens=body.max_tokens, temperature=body.temperature,
                              ignore_eos=body.ignore_eos,
                              explain_tokens=svc.settings.limits.max_explain_tokens if body.explain else 0)
    run = await QueryRun.start(svc, params, request, "query")
    if body.stream:
        return sse(run, query_events(run))
    return run.response(await run.result(request))


async def query_events(run: QueryRun) -> AsyncIterator[ServerSentEvent]:
    """`event: delta` {"delta": text} per piece of text, then `event: result`: the whole response."""
    async for event in run.events():
        if isinstance(event, str):
            yield ServerSentEvent(json.dumps({"delta": event}), event="delta")
        else:
            yield ServerSentEvent(run.response(event).model_dump_json(), event="result")


@router.post("/v1/chat/completions", response_model=ChatCompletion,
             responses={200: SSE, **ERRORS, **MODEL_NOT_FOUND})
async def chat_completions(body: ChatCompletionRequest, request: Request, response: Response,
                           svc: Service = Depends(service)):
    """Every message goes into the prompt through the model's chat template (tool calls and results too), each
    a piece whose KV is reused wherever it reappears: as an exact prefix after the same tokens, else shifted and
    blended (usage.prompt_tokens_details). With retrieval (the default; `retrieval: false` or the model
    `<model>-chat` turn it off) the last user message is the question, asked over the passages retrieved for it
    (app.engine.conversation makes a follow-up self-contained for the search)."""
    params = await chat_params(body, svc)
    run = await QueryRun.start(svc, params, request, "chat")
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": svc.model_name + ("" if params.retrieve else NO_RETRIEVAL)}

    async def retain(result: QueryResult) -> LeaseNote | None:
        """prompt_cache_retention 24h: the prompt's KV leased to the prompt_cache_key (app.engine.prompt_cache)."""
        if body.prompt_cache_retention not in RETENTION_TTL_S:
            return None
        return await svc.blocking("store", lease, svc.serving.store, body.prompt_cache_key or DEFAULT_FAMILY,
                                  [([u.key for u in result.kv_keys], RETENTION_TTL_S[body.prompt_cache_retention])])

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse(run, chat_chunks(run, head, include_usage, retain, params.tool_calls, params.prefill))
    result = await run.result(request)
    note = await retain(result)
    response.headers.update(lease_headers(note))
    calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in result.tool_calls]
    message = ChatMessageOut(content=result.answer or (None if calls else ""), tool_calls=calls or None)
    return ChatCompletion(**head, usage=usage_of(result), sources=result.sources,
                          dropped_messages=result.stats.dropped_messages, lease=note,
                          choices=[Choice(message=message, finish_reason=finish_reason(result),
                                          logprobs=await choice_logprobs(svc, result))])


async def choice_logprobs(svc: Service, result: QueryResult) -> ChoiceLogprobs | None:
    """OpenAI's logprobs of the answer's tokens (each one's text, logprob, UTF-8 bytes and alternatives), where
    the request asked for them, the tokens decoded off the event loop. A logprob too small for a float is
    -9999.0, as OpenAI writes it."""
    if result.logprobs is None:
        return None
    ids = [t for lp in result.logprobs for t in (lp.token, *(i for i, _ in lp.top))]
    texts = iter(await svc.blocking("lookup", svc.token_texts, ids))

    def entry(logprob: float) -> dict[str, Any]:
        text = next(texts)
        return {"token": text, "logprob": max(logprob, -9999.0), "bytes": list(text.encode())}
    return ChoiceLogprobs(content=[TokenLogprobOut(**entry(lp.logprob), top_logprobs=[
        TopLogprob(**entry(value)) for _, value in lp.top]) for lp in result.logprobs])


async def chat_params(body: ChatCompletionRequest, svc: Service) -> QueryParams:
    """A chat request's engine parameters, its limits checked (LimitError: 422 naming the field)."""
    check_model(svc, body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    body.question()  # 422 without a user message
    limits = svc.settings.limits
    if len(body.messages) > limits.max_messages:
        raise LimitError("messages", f"at most {limits.max_messages} messages (got {len(body.messages)})")
    chat = Conversation.from_messages(body.messages)
    retrieve = body.retrieval if body.retrieval is not None else body.model != svc.model_name + NO_RETRIEVAL
    # the question limit is the retrieval question's: without retrieval a message may carry documents (budget only)
    try:
        check_limits(limits, question=chat.question if retrieve else "", top_k=body.top_k, question_field="messages",
                     max_tokens={"max_completion_tokens": body.max_completion_tokens, "max_tokens": body.max_tokens})
    except LimitError as exc:
        if exc.param != "messages":
            raise
        detail = str(exc).removeprefix("messages: ")
        raise LimitError("messages", f"the question (the last user message) is {detail} on {svc.model_name!r}, "
                                     f"which retrieves for it; send long text (a stuffed prompt) to "
                                     f"{svc.model_name + NO_RETRIEVAL!r}, which answers without retrieval") from None
    texts = [(f"messages.{i}", message.budget_text()) for i, message in enumerate(body.messages)]
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    grammar = answer_grammar(body, tools)
    texts += [("tools", json.dumps(tools))] if tools else []
    await svc.blocking("lookup", check_budget, limits, texts, svc.count_tokens, "messages")
    return svc.query_params(chat.question, top_k=body.top_k, mode=body.mode, ratio=body.recompute_ratio,
                            max_tokens=body.new_tokens(), temperature=body.temperature or 0.0,
                            top_p=body.top_p or 1.0, stop=tuple(body.stop), seed=body.seed,
                            messages=tuple(m.as_prompt() for m in body.messages), tools=tuple(tools),
                            retrieve=retrieve, retrieval_query=chat.retrieval_query(),
                            grammar=grammar, tool_calls=bool(tools) and body.tool_choice != "none",
                            top_logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                            continue_final=body.continue_final_message and body.messages[-1].role == "assistant")


def answer_grammar(body: ChatCompletionRequest, tools: list[dict]) -> str | None:
    """What the answer must be (app.engine.tool_calls): its grammar under tool_choice and response_format; a 400 for
    what this server cannot give (a part that is not text) or a choice it cannot follow."""
    for i, message in enumerate(body.messages):
        for part in message.content if isinstance(message.content, list) else ():
            if part.type != "text":
                raise ApiError(400, f"messages.{i}: a {part.type} part: this model reads text only",
                               param=f"messages.{i}.content")
    choice = body.tool_choice.function.name if isinstance(body.tool_choice, NamedToolChoice) else body.tool_choice
    format_ = body.response_format.model_dump(by_alias=True) if body.response_format else None
    try:
        return choice_grammar(tools, choice or "auto", body.parallel_tool_calls is not False,
                              response_schema(format_))
    except ToolChoiceError as exc:
        raise ApiError(400, str(exc), param="tool_choice") from None
    except SchemaLimitError as exc:
        raise ApiError(400, str(exc), param="response_format" if "response_format" in str(exc) else "tools") from None


async def chat_chunks(run: QueryRun, head: dict[str, Any], include_usage: bool,
                      retain: Callable[[QueryResult], Awaitable[LeaseNote | None]], calls: bool = False,
                      prefill: str = "") -> AsyncIterator[ServerSentEvent]:
    """OpenAI's stream: a role chunk, content chunks, a finish chunk (with the lease), [a usage chunk,] [DONE].
    With `calls` (tools), a call's chunks instead of its text: its index, id and name, then its arguments in
    fragments (a call the `prefill` opened, whole)."""
    def chunk(delta: Delta | None, finish: str | None = None, usage: Usage | None = None, dropped: int | None = None,
              note: LeaseNote | None = None, logprobs: ChoiceLogprobs | None = None) -> ServerSentEvent:
        choices = [] if delta is None else [ChunkChoice(delta=delta, finish_reason=finish, logprobs=logprobs)]
        return ServerSentEvent(ChatCompletionChunk(**head, choices=choices, usage=usage, dropped_messages=dropped,
                                                   lease=note).model_dump_json(exclude_none=False))

    yield chunk(Delta(role="assistant", content=""))
    index = -1  # the last call's
    async for kind, event in answer_parts(run.events(), calls, prefill):
        if kind == "text":
            yield chunk(Delta(content=event))
        elif kind == "call":
            index += 1
            yield chunk(Delta(tool_calls=[{"index": index, "id": event.id, "type": "function",
                                           "function": {"name": event.name, "arguments": ""}}]))
            for fragment in fragments(event.arguments):
                yield chunk(Delta(tool_calls=[{"index": index, "function": {"arguments": fragment}}]))
        else:
            note = await retain(event)
            yield chunk(Delta(), finish=finish_reason(event), dropped=event.stats.dropped_messages, note=note,
                        logprobs=await choice_logprobs(run.svc, event))
            if include_usage:
                yield chunk(None, usage=usage_of(event))
    yield ServerSentEvent("[DONE]")


def usage_of(result: QueryResult) -> Usage:
    s = result.stats
    return Usage(prompt_tokens=s.prompt_tokens, completion_tokens=s.completion_tokens,
                 total_tokens=s.prompt_tokens + s.completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=s.cached_tokens, exact_tokens=s.exact_tokens,
                                                           recomputed_tokens=s.recomputed_tokens))


def finish_reason(result: QueryResult) -> str:
    """"length" whenever max_tokens cut the answer (its whole calls still returned, the cut one dropped)."""
    if result.finish_reason == "length":
        return "length"
    return "tool_calls" if result.tool_calls else "stop"  # "cancelled" never reaches a client
