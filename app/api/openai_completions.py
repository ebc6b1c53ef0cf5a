"""OpenAI's legacy completions, POST /v1/completions: a raw prompt continued, no chat template (what lm-eval-style
harnesses send). The prompt, a string (or a list of one) tokenized as the model's tokenizer does by default, or
token ids, is the engine's prompt as it is: one piece whose KV is stored and reused (a repeated prompt reads it
back: usage.prompt_tokens_details.cached_tokens), its last token computed for the logits. The same engine,
planner and decode loop as a chat, retrieval off. One completion a request; `echo`, `suffix`, `n` and `best_of`
over 1 are refused with a 400 (stated in the schema). `logprobs` are the generated tokens' (the prompt's would need
its logits, which a reused KV does not give)."""
from __future__ import annotations

import itertools
import time
import uuid
from typing import Annotated, Any, AsyncIterator, Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field, field_validator
from sse_starlette import ServerSentEvent

from app.api.deps import service
from app.api.errors import ApiError
from app.api.query_routes import SSE, QueryRun, check_model, choice_logprobs, finish_reason, sse, usage_of
from app.api.schemas.openai import StreamOptions, Usage, at_most_4_stops, stop_sequences
from app.api.schemas.ragblend import ERRORS, MAX_SEED, MODEL_NOT_FOUND, LimitError, OpenAIBody, Text, check_limits
from app.engine.query import QueryParams, QueryResult
from app.serving.service import Service

router = APIRouter()
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for a completion
MAX_COMPLETION_LOGPROBS = 5  # alternatives a token's logprobs may list (OpenAI's bound for completions)
PromptText = Annotated[Text, Field(min_length=1)]


class CompletionRequest(OpenAIBody):
    model: Text | None = Field(None, description="One of the ids GET /v1/models lists (another is a 404).")
    prompt: PromptText | Annotated[list[PromptText], Field(min_length=1, max_length=1)] | Annotated[
        list[Annotated[int, Field(ge=0)]], Field(min_length=1)] = Field(description=(
        "The text to continue, as it is (no chat template): a string, a list of one string, or token ids."))
    max_tokens: int | None = Field(None, ge=1, description=f"Default {DEFAULT_MAX_TOKENS}.")
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False, description="Default 0 (greedy).")
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    stop: Text | list[Text] | None = Field(None, validate_default=True, json_schema_extra=at_most_4_stops)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    # not supported: stated in the schema, a 400 at the route (as OpenAI words its refusals)
    n: int | None = Field(None, ge=1, json_schema_extra={"maximum": 1}, description="Only 1 is supported.")
    best_of: int | None = Field(None, ge=1, json_schema_extra={"maximum": 1}, description="Only 1 is supported.")
    echo: bool | None = Field(None, json_schema_extra={"enum": [False, None]}, description="Not supported: true "
                                                                                          "is a 400.")
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS, description=(
        "Each token's log-probability under the model and this many alternatives (streamed: on the last chunk)."))
    suffix: Text | None = Field(None, json_schema_extra={"enum": [None]}, description="Not supported: a 400.")

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str]:
        return stop_sequences(value)

    @field_validator("prompt", mode="before")
    @classmethod
    def _integral_ids(cls, value: Any) -> Any:
        """Token ids as JSON Schema counts integers: 2.0 (or 1e20) is an integer (RequestBody's rule, a level down)."""
        if isinstance(value, list):
            return [int(v) if isinstance(v, float) and v.is_integer() else v for v in value]
        return value


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    text: str
    index: int = 0
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


@router.post("/v1/completions", response_model=Completion, responses={200: SSE, **ERRORS, **MODEL_NOT_FOUND})
async def completions(body: CompletionRequest, request: Request, svc: Service = Depends(service)):
    """The prompt continued (see the module docstring); streamed as `text_completion` chunks, then [DONE]."""
    params = await completion_params(body, svc)
    run = await QueryRun.start(svc, params, request, "completion")
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": body.model or svc.model_name}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse(run, completion_chunks(run, head, include_usage))
    result = await run.result(request)
    choice = CompletionChoice(text=result.answer, finish_reason=finish_reason(result),
                              logprobs=await completion_logprobs(svc, result))
    return Completion(**head, choices=[choice], usage=usage_of(result))


async def completion_logprobs(svc: Service, result: QueryResult) -> CompletionLogprobs | None:
    """The legacy form of the answer's logprobs: tokens, their logprobs, {token: logprob} alternatives, offsets."""
    chosen = await choice_logprobs(svc, result)
    if chosen is None:
        return None
    offsets = [0, *itertools.accumulate(len(t.token) for t in chosen.content)][:-1]
    return CompletionLogprobs(tokens=[t.token for t in chosen.content],
                              token_logprobs=[t.logprob for t in chosen.content],
                              top_logprobs=[{a.token: a.logprob for a in t.top_logprobs} for t in chosen.content],
                              text_offset=offsets)


async def completion_params(body: CompletionRequest, svc: Service) -> QueryParams:
    check_model(svc, body.model)
    for name, value, ok in (("n", body.n, 1), ("best_of", body.best_of, 1), ("echo", body.echo, False),
                            ("suffix", body.suffix, None)):
        if value is not None and value != ok:
            raise ApiError(400, f"{name}: not supported by this server (one completion, no echo or suffix)",
                           param=name)
    limits = svc.settings.limits
    check_limits(limits, question="", top_k=None, max_tokens={"max_tokens": body.max_tokens})
    prompt = body.prompt[0] if isinstance(body.prompt, list) and isinstance(body.prompt[0], str) else body.prompt
    try:
        ids = await svc.blocking("lookup", svc.token_ids, prompt)
    except ValueError as exc:  # a token id past the vocabulary
        raise ApiError(400, f"prompt: {exc}", param="prompt") from None
    budget = min(limits.max_message_tokens, limits.max_prompt_tokens)
    if len(ids) > budget:
        raise LimitError("prompt", f"{len(ids)} tokens, over limits.max_message_tokens / max_prompt_tokens ({budget})")
    return svc.query_params(prompt if isinstance(prompt, str) else "", top_k=None,
                            max_tokens=body.max_tokens or min(DEFAULT_MAX_TOKENS, limits.max_new_tokens),
                            temperature=body.temperature or 0.0, top_p=body.top_p or 1.0, stop=tuple(body.stop),
                            seed=body.seed, retrieve=False, prompt_ids=tuple(ids), top_logprobs=body.logprobs)


async def completion_chunks(run: QueryRun, head: dict[str, Any], include_usage: bool
                            ) -> AsyncIterator[ServerSentEvent]:
    """A chunk per piece of text, a finish chunk, [a usage chunk,] [DONE]."""
    def chunk(text: str | None, finish: str | None = None, usage: Usage | None = None,
              logprobs: CompletionLogprobs | None = None) -> ServerSentEvent:
        choices = [] if text is None else [CompletionChoice(text=text, finish_reason=finish, logprobs=logprobs)]
        return ServerSentEvent(Completion(**head, choices=choices, usage=usage).model_dump_json())

    async for event in run.events():
        if isinstance(event, str):
            yield chunk(event)
            continue
        yield chunk("", finish=finish_reason(event), logprobs=await completion_logprobs(run.svc, event))
        if include_usage:
            yield chunk(None, usage=usage_of(event))
    yield ServerSentEvent("[DONE]")


@router.api_route("/v1/responses", methods=["GET", "POST"], include_in_schema=False)
@router.api_route("/v1/responses/{rest:path}", methods=["GET", "POST", "DELETE"], include_in_schema=False)
async def responses_not_served() -> None:
    """OpenAI's Responses API is not served (it keeps conversations server-side): said plainly, not a bare 404."""
    raise ApiError(404, "/v1/responses (OpenAI's Responses API) is not served by this server: use "
                        "POST /v1/chat/completions (or Anthropic's POST /v1/messages)", code="not_served")
