"""Request and response schemas of the OpenAI-compatible endpoints (/v1/chat/completions, /v1/models); the rules
they share with ragblend's own endpoints (app.api.schemas.ragblend) are stated there."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from app.api.schemas.ragblend import ID_RULE, MAX_SEED, CacheKey, Id, LimitError, OpenAIBody, Text
from app.engine.prompt_cache import RETENTION_TTL_S, LeaseNote
from app.engine.query import Mode, Source
from app.engine.tool_calls import CLOSE, MAX_SCHEMA_CHARS, MAX_SCHEMA_DEPTH, OPEN
from app.validation import NOT_BLANK
from blend.decode import MAX_TOP_LOGPROBS
from blend.grammar import MAX_PATTERNS


class TextPart(OpenAIBody):
    type: Annotated[Text, WithJsonSchema({"const": "text"})] = Field(description=(
        "text; any other part (image_url, input_audio, file) is a 400: this model reads text only"))
    text: Text | None = None


class FunctionCall(OpenAIBody):
    name: Id
    arguments: Text = Field(description="The call's arguments, as the model wrote them (JSON text).")


class ToolCall(OpenAIBody):
    id: Id
    type: Literal["function"] = "function"
    function: FunctionCall


# a tool's name holding the call markup: its calls would not be told from text (app.engine.tool_calls.check_name)
ToolName = Annotated[Id, Field(json_schema_extra={"not": {"pattern": f"{OPEN}|{CLOSE}"}},
                               description=f"{ID_RULE} Without the call markup ({OPEN}, {CLOSE}).")]


class FunctionDef(OpenAIBody):
    name: ToolName
    description: Text | None = None
    parameters: JsonSchema | None = None


class Tool(OpenAIBody):
    type: Literal["function"] = "function"
    function: FunctionDef


# ChatMessage's rules across fields, in JSON Schema: a tool message names its call, a function message its
# function, and only an assistant message has tool calls.
_MESSAGE_RULES = {"allOf": [
    {"if": {"properties": {"role": {"const": "tool"}}, "required": ["role"]},
     "then": {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string"}}}},
    {"if": {"properties": {"role": {"const": "function"}}, "required": ["role"]},
     "then": {"required": ["name"], "properties": {"name": {"type": "string"}}}},
    {"if": {"properties": {"tool_calls": {"type": "array", "minItems": 1}}, "required": ["tool_calls"]},
     "then": {"properties": {"role": {"const": "assistant"}}}},
    # every message says something: text content, or (an assistant's) tool calls
    {"anyOf": [{"required": ["content"], "properties": {"content": {"anyOf": [
        {"type": "string", "pattern": r"\S"}, {"type": "array", "minItems": 1}]}}},
        {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array", "minItems": 1}}}]}]}


class ChatMessage(OpenAIBody):
    """A chat message. Every one goes into the prompt, rendered by the model's chat template: tool results
    (role tool, with the `tool_call_id` they answer) and an assistant's `tool_calls` included."""

    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra=_MESSAGE_RULES)

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Text | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="An assistant message's calls.")
    tool_call_id: Id | None = Field(
        None, description="Required on a tool message: the call it answers.")
    name: Annotated[str, Field(min_length=1, max_length=256)] | None = None

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id (the id of the call it answers)")
        if self.role == "function" and self.name is None:
            raise ValueError("a function message needs name")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        empty = self.content is None or (self.content.strip() == "" if isinstance(self.content, str) else
                                         not self.content)
        if empty and not self.tool_calls:
            raise ValueError("a message needs content (or, an assistant's, tool_calls): this one says nothing")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: keep the text ones
            return "\n".join(p.text for p in self.content if p.type == "text" and p.text)
        return self.content or ""

    def budget_text(self) -> str:
        """What counts against the token budgets: its text and its calls."""
        calls = [f"{c.function.name} {c.function.arguments}" for c in self.tool_calls or []]
        return "\n".join([self.text(), *calls])

    def as_prompt(self) -> dict[str, Any]:
        """The message as the engine renders it (an OpenAI/HF chat-template dict); a legacy function message
        is a tool message."""
        message: dict[str, Any] = {"role": "tool" if self.role == "function" else self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message


class NamedFunction(OpenAIBody):
    name: Id


class NamedToolChoice(OpenAIBody):
    type: Literal["function"] = "function"
    function: NamedFunction


def schema_object(value: dict[str, Any] | bool) -> dict[str, Any]:
    """A JSON Schema as an object: `true` (valid JSON Schema: anything) is {}; `false` admits no answer at all."""
    if value is False:
        raise ValueError("false admits no value at all: send a schema an answer can meet (true: any JSON)")
    return {} if value is True else value


# A JSON Schema where one is taken (response_format, tool parameters, Anthropic input_schema): an object, or `true`
JsonSchema = Annotated[dict[str, Any] | bool, AfterValidator(schema_object),
                       WithJsonSchema({"anyOf": [{"type": "object"}, {"const": True}]})]


class JsonSchemaFormat(OpenAIBody):
    name: Annotated[str, Field(min_length=1, max_length=64)] = "response"
    description: Text | None = None
    schema_: JsonSchema | None = Field(None, alias="schema")
    strict: bool | None = None


# response_format json_schema needs its json_schema (an object), in JSON Schema
_JSON_SCHEMA_GIVEN = {"if": {"properties": {"type": {"const": "json_schema"}}, "required": ["type"]},
                      "then": {"required": ["json_schema"], "properties": {"json_schema": {"type": "object"}}}}


class ResponseFormat(OpenAIBody):
    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra=_JSON_SCHEMA_GIVEN)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format json_schema needs json_schema")
        return self


class StreamOptions(OpenAIBody):
    include_usage: bool = False


# What `question()` needs, in JSON Schema: a user message whose content (or one of its text parts) is not blank.
_WITH_TEXT = {"type": "string", "pattern": NOT_BLANK}
_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": _WITH_TEXT}}
USER_TEXT = {"type": "object", "required": ["role", "content"], "properties": {
    "role": {"const": "user"}, "content": {"anyOf": [_WITH_TEXT, {"type": "array", "contains": _TEXT_PART}]}}}


def at_most_4_stops(schema: dict[str, Any]) -> None:
    for branch in schema["anyOf"]:
        if branch.get("type") == "array":
            branch["maxItems"] = 4


def stop_sequences(value: str | list[str] | None) -> list[str]:
    """`stop` as a list (at most 4; OpenAI's limit), empty strings left out."""
    stops = [value] if isinstance(value, str) else list(value or [])
    if len(stops) > 4:
        raise ValueError("at most 4 stop sequences")
    return [s for s in stops if s]  # an empty stop string would end every answer at once


# top_logprobs only with logprobs: true, in JSON Schema
TOP_LOGPROBS_RULE = {"if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
                     "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}}
# a call forced (required, or a named function) needs tools to call (which of them it names is a reference across
# fields, no JSON Schema keyword's: a 400)
FORCED_CALL_RULE = {"if": {"required": ["tool_choice"], "properties": {"tool_choice": {"anyOf": [
    {"const": "required"}, {"type": "object"}]}}},
    "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}}
CHAT_RULES = {"allOf": [TOP_LOGPROBS_RULE, FORCED_CALL_RULE]}


class ChatCompletionRequest(OpenAIBody):
    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra=CHAT_RULES)

    model: Text | None = Field(None, description="One of the ids GET /v1/models lists (another is a 404 "
                                                "model_not_found): `<model>-chat` turns retrieval off.")
    messages: list[ChatMessage] = Field(min_length=1, json_schema_extra={"contains": USER_TEXT}, description=(
        "The conversation: at least one user message with text; the last such message is the question."))
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    stop: Text | list[Text] | None = Field(None, validate_default=True, json_schema_extra=at_most_4_stops)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=1, description="Only 1 is supported.")
    user: Text | None = None
    prompt_cache_key: CacheKey | None = Field(None, description=(
        "The lease family of this request's KV (GET/DELETE /v1/cache?prompt_cache_key=...)."))
    prompt_cache_retention: Literal["in_memory", *RETENTION_TTL_S] | None = Field(  # type: ignore[valid-type]
        None, description="in_memory (the default): the prompt's KV stays under plain LRU; 24h: it is leased for "
                          "24 h (renewed by each hit), see the response's `lease` and x-ragblend-lease header.")
    tools: list[Tool] | None = Field(None, description="Functions the model may call: rendered into the prompt "
                                                      "through the model's chat template. A name holding the call "
                                                      "markup (<tool_call>, </tool_call>) is a 400; parameters are "
                                                      "schemas as response_format's (their $defs/$ref resolve "
                                                      "within each tool's parameters).")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(None, description=(
        "Enforced by grammar-constrained decoding: none (text, never a call), auto (the default with tools: text "
        "until the model opens a call, then a valid call; with a json_schema response_format: the schema's "
        "document or calls, never text), required (calls only), or a named function (one call of it, one of "
        "`tools`); required and a named function need tools."))
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call (default: several).")
    response_format: ResponseFormat | None = Field(None, description=(
        f"json_object or json_schema: the answer is a JSON document (of the schema), enforced by grammar-"
        f"constrained decoding. A schema (a tool's parameters too) has at most {MAX_SCHEMA_CHARS} characters of "
        f"JSON and {MAX_SCHEMA_DEPTH} levels of nesting, and one value must match at most {MAX_PATTERNS} string "
        f"patterns at once (allOf, $ref); a schema no finite document satisfies ($ref cycles, an object requiring "
        f"itself), or one the grammar engine cannot compile within limits.grammar_compile_s (default 2 s), is a "
        f"400 before any prefill (a failed schema is remembered: its resend is refused at once)."))
    logprobs: bool | None = Field(None, description=(
        "true: each answer token's log-probability under the model (before temperature, top_p and a grammar's "
        "mask), in `choices[0].logprobs.content`; streamed, all of them on the finish chunk."))
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description=(
        "With logprobs: true, the likeliest tokens at each position with theirs (without it, a 400)."))
    # ragblend extras
    top_k: int | None = Field(None, ge=1)
    mode: Mode = "blend"
    recompute_ratio: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    retrieval: bool | None = Field(None, description=(
        "ragblend extra (the openai client: extra_body): false answers from the messages alone, no passages "
        "retrieved; default true, false under the served name `<model>-chat` (GET /v1/models lists both)."))
    continue_final_message: bool = Field(False, description=(
        "vLLM's extra: true, with an assistant's message last, makes it a prefill: the answer's start, which the "
        "model continues (the content holds the continuation; under a grammar, the prefill must be a start it "
        "allows). Otherwise, as OpenAI's API, an assistant's message last is a finished turn, answered by a new one."))

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str]:
        return stop_sequences(value)

    def question(self) -> str:
        """The last user message with text (app.engine.conversation lays out the rest of the conversation)."""
        for message in reversed(self.messages):
            if message.role == "user" and message.text().strip():
                return message.text()
        raise LimitError("messages", "needs a user message with text")

    def new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] = Field(description="The token's text as UTF-8 bytes.")


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobOut]


class Choice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: str
    logprobs: ChoiceLogprobs | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens whose KV was read from the store and not recomputed.")
    exact_tokens: int = Field(0, description="ragblend extra: of those, the exact prefix (used as is).")
    recomputed_tokens: int = Field(0, description="ragblend extra: tokens read from the store but recomputed by "
                                                  "the blend (not in cached_tokens).")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    system_fingerprint: str | None = None
    sources: list[Source] = Field(default_factory=list, description="ragblend extra: the retrieved passages.")
    dropped_messages: int = Field(0, description="ragblend extra: the oldest earlier messages left out of the "
                                                 "prompt because the conversation did not fit the context.")
    lease: LeaseNote | None = Field(None, description="ragblend extra, with prompt_cache_retention 24h: the lease.")


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = Field(None, description="index, id, type and function (name, "
                                                                     "arguments fragment) of a call")


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = Field(None, description="With logprobs: true, on the finish chunk: every "
                                                              "token's.")


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    dropped_messages: int | None = Field(None, description="ragblend extra, on the finish chunk: see ChatCompletion.")
    lease: LeaseNote | None = Field(None, description="ragblend extra, on the finish chunk: see ChatCompletion.")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ragblend"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
