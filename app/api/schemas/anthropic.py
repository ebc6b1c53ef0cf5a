"""Request and response schemas of Anthropic's Messages API (POST /v1/messages, app.api.anthropic_routes)."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.api.schemas.openai import JsonSchema, ToolName
from app.api.schemas.ragblend import MAX_SEED, RETRY_AFTER, CacheKey, Id, NonBlank, RequestBody, Text
from app.engine.prompt_cache import LeaseNote


class AnthropicBody(RequestBody):
    model_config = ConfigDict(strict=True, extra="ignore")


class CacheControl(AnthropicBody):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


BREAKPOINT = ("A prompt caching breakpoint: the prefix up to here is leased for its ttl. Any number in a request "
              "(each lease counts against the tenant's pinned bytes, not a count).")


class Cacheable(AnthropicBody):
    cache_control: CacheControl | None = Field(None, description=BREAKPOINT)


class TextBlock(Cacheable):
    type: Literal["text"]
    text: NonBlank = Field(description="Not blank (as Anthropic's API requires).")


class ToolUseBlock(Cacheable):
    type: Literal["tool_use"]
    id: Id
    name: Id
    input: dict[str, Any]


class ToolResultBlock(Cacheable):
    type: Literal["tool_result"]
    tool_use_id: Id
    content: Text | list[TextBlock] = ""
    is_error: bool = False


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class Message(AnthropicBody):
    role: Literal["user", "assistant"]
    content: NonBlank | Annotated[list[Block], Field(min_length=1)]


class Tool(Cacheable):
    name: ToolName
    description: Text | None = None
    input_schema: JsonSchema = Field(default_factory=dict)


class ToolChoice(AnthropicBody):
    type: Literal["auto", "any", "none"]
    disable_parallel_tool_use: bool = False


class NamedToolChoice(AnthropicBody):
    type: Literal["tool"]
    name: Id = Field(description="One of `tools` (another is a 400).")
    disable_parallel_tool_use: bool = False


class Thinking(AnthropicBody):
    """Extended thinking is not supported: only its `disabled` form is taken (an enabled one is a 400 naming it)."""
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["disabled"]


class Metadata(AnthropicBody):
    user_id: CacheKey | None = Field(None, description="The lease family's name (anthropic:<user_id>).")


# tool_choice any or tool (a call forced) needs tools to call (which of them `name` names is a reference across
# fields, no JSON Schema keyword's: a 400)
FORCED_CALL_RULE = {"if": {"required": ["tool_choice"], "properties": {"tool_choice": {
    "type": "object", "required": ["type"], "properties": {"type": {"enum": ["any", "tool"]}}}}},
    "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}}
# retrieval asks the last user message (the question): with it, there is one (else the messages may all be an
# assistant's: a prefill alone)
RETRIEVAL_RULE = {"if": {"required": ["retrieval"], "properties": {"retrieval": {"const": True}}},
                  "then": {"properties": {"messages": {"contains": {"properties": {"role": {"const": "user"}}}}}}}


class CountTokensRequest(AnthropicBody):
    """POST /v1/messages/count_tokens: a Messages request without max_tokens (what else it holds is ignored)."""
    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra={"allOf": [FORCED_CALL_RULE,
                                                                                        RETRIEVAL_RULE]})

    model: Text = Field(description="One of the ids GET /v1/models lists (another is a 404 not_found_error).")
    messages: list[Message] = Field(min_length=1, description=(
        "The conversation. The last user message is the question; an assistant's message last is a prefill: the "
        "answer's start, which the model continues (the response holds the continuation)."))
    system: Text | list[TextBlock] | None = None
    tools: list[Tool] = Field(default_factory=list, description=(
        "A name holding the call markup (<tool_call>, </tool_call>) is a 400. input_schema: as OpenAI's "
        "response_format schemas (its $defs/$ref resolve within it; the same limits, refused with a 400 before any "
        "prefill)."))
    tool_choice: Annotated[ToolChoice | NamedToolChoice, Field(discriminator="type")] | None = Field(
        None, description=(
        "Enforced by grammar-constrained decoding: auto (text until the model opens a call, then a valid call), "
        "any (calls only), tool (one call of `name`, which must be one of `tools`), none (text only); any and "
        "tool need tools."))
    cache_control: CacheControl | None = Field(None, description=f"On the last block (automatic caching). {BREAKPOINT}")
    thinking: Thinking | None = Field(None, description="Extended thinking is not supported: `{\"type\": "
                                                        "\"disabled\"}` or nothing (enabled is a 400).")
    # ragblend extras
    retrieval: bool = Field(False, description="Retrieve passages for the question, the last user message (there "
                                               "must be one; default: off).")
    retrieval_top_k: int | None = Field(None, ge=1, description="With retrieval: passages (default: retrieval.top_k).")
    # sampling: checked here too, so count_tokens refuses what /v1/messages refuses
    temperature: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    stop_sequences: list[Text] = Field(default_factory=list, max_length=4)
    stream: bool = False
    metadata: Metadata | None = None
    top_k: int | None = Field(None, ge=1, description="Anthropic's sampling top_k: accepted and ignored (ragblend "
                                                      "samples with temperature and top_p); not the passages.")
    # ragblend extra
    seed: int | None = Field(None, ge=0, le=MAX_SEED)


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)


class CacheCreation(BaseModel):
    ephemeral_5m_input_tokens: int
    ephemeral_1h_input_tokens: int


class MessageUsage(BaseModel):
    input_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    cache_creation: CacheCreation
    output_tokens: int


class TextOut(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseOut(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class AnthropicErrorDetail(BaseModel):
    type: str = Field(description="invalid_request_error, authentication_error, request_too_large, "
                                  "rate_limit_error, overloaded_error, api_error...")
    message: str


class AnthropicError(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": AnthropicError, **({"headers": RETRY_AFTER} if code in (429, 503) else {})}
    for code in (400, 401, 404, 413, 429, 503)}  # 404: an unknown model id (not_found_error)


class TokenCount(BaseModel):
    input_tokens: int = Field(description="The prompt's tokens as the server renders it (chat template, system, "
                                          "tools, and passages with retrieval).")


class MessageOut(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextOut | ToolUseOut]
    stop_reason: str | None
    stop_sequence: str | None = None
    usage: MessageUsage
    lease: LeaseNote | None = Field(None, description="ragblend extra: the lease of the cache_control prefixes.")
