"""Request and response schemas of the HTTP API: ragblend's own (/v1/query, /v1/documents) and
the OpenAI-compatible chat completions.

Static bounds live here (and so in the OpenAPI spec); the limits that come from settings (question
length, top_k, max_tokens: `check_limits`; prompt tokens per message and in all: `check_budget`) give
the same 422 shape, and `state_limits` writes them into the app's OpenAPI description. Every rule the
server enforces is stated there, as a schema keyword where JSON Schema can say it, else in words.
Our own endpoints reject unknown fields; the OpenAI ones ignore them, as OpenAI clients send
fields we have no use for.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass

from app.config import LimitsSettings
from app.conversation import CHARS_PER_TOKEN_BOUND
from app.engine import Mode, QueryStats, Source
from app.validation import (MAX_ID_CHARS, MAX_TITLE_CHARS, NO_CONTROL_CHARS, NOT_BLANK, ONE_LINE_NOT_BLANK,
                            not_blank, valid_doc_id, valid_title, valid_unicode)
from app.explain import Explain
from app.prompt_cache import RETENTION_TTL_S, LeaseNote
from app.ingest import SUFFIXES
from retrieval import DocumentInfo
from blend.selection import POLICIES

MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed's range
MAX_CACHE_KEY_CHARS = 1024  # a prompt_cache_key's length at most, wherever one is taken


class LimitError(ValueError):
    """A field over a configured limit (HTTP 422, naming the field)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


# Every string a client sends is valid Unicode (app/validation.py has the rules); ids and titles carry
# their rules in the schema too, so the OpenAPI spec documents them.
Text = Annotated[str, AfterValidator(valid_unicode)]
NonBlank = Annotated[str, Field(pattern=NOT_BLANK), AfterValidator(not_blank), AfterValidator(valid_unicode)]
DocId = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS, pattern=ONE_LINE_NOT_BLANK,
                             description="One line, not blank, no control characters."), AfterValidator(valid_doc_id)]
Title = Annotated[str, Field(max_length=MAX_TITLE_CHARS, pattern=NO_CONTROL_CHARS,
                             description="One line, no control characters."), AfterValidator(valid_title)]


class RequestBody(BaseModel):
    """Strict types (no true for 1, no "yes" for true), but 2.0 is the integer 2, as JSON Schema counts it."""

    model_config = ConfigDict(strict=True)

    @model_validator(mode="before")
    @classmethod
    def _integral_floats(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        ints = {name for name, f in cls.model_fields.items() if int in (f.annotation, *get_args(f.annotation))}
        return {k: int(v) if k in ints and isinstance(v, float) and v.is_integer() else v for k, v in data.items()}


class StrictBody(RequestBody):
    """A request body of our own: unknown fields refused."""

    model_config = ConfigDict(strict=True, extra="forbid")


class OpenAIBody(RequestBody):
    """An OpenAI-shaped request: unknown fields ignored (clients send many)."""

    model_config = ConfigDict(strict=True, extra="ignore")


# ---- errors ------------------------------------------------------------------------------------

class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str = Field(description="Machine-readable reason, e.g. invalid_value, queue_full.")
    param: str | None = Field(None, description="The request field at fault, when one is.")


class ErrorResponse(BaseModel):
    error: ErrorDetail


RETRY_AFTER = {"Retry-After": {"description": "Seconds after which a retry may succeed.", "required": True,
                               "schema": {"type": "integer", "minimum": 1}}}
# The error responses a route documents in the OpenAPI schema: every 429 and 503 says when to retry.
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, **({"headers": RETRY_AFTER} if code in (429, 503) else {})}
    for code in (400, 401, 413, 422, 429, 503)}
DOCUMENT_ERRORS = {**ERRORS, 409: {"model": ErrorResponse, "description": "A different document has that id "
                                                                          "(and replace is not true)."},
                   415: {"model": ErrorResponse}}


# ---- /v1/query ---------------------------------------------------------------------------------

class QueryRequest(StrictBody):
    question: NonBlank = Field(min_length=1)
    top_k: int | None = Field(None, ge=1, description="Passages to retrieve (default: retrieval.top_k).")
    mode: Mode = Field("blend", description="blend: cached chunk KV + selective recompute; full: plain "
                                            "prefill; reuse: cached chunk KV, nothing recomputed; prefix: only "
                                            "the exact prefix reused, the rest computed (prefix caching).")
    recompute_ratio: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False,
                                          description="Share of cached tokens recomputed (default: blend.ratio).")
    selection: Literal[tuple(sorted(POLICIES))] | None = Field(  # type: ignore[valid-type]
        None, description="Selection policy of the tokens to recompute (default: blend.selection).")
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=2.0, allow_inf_nan=False)
    stream: bool = False
    ignore_eos: bool = Field(False, description="Generate max_tokens tokens whatever the model says "
                                                "(for benchmarks, as vLLM's ignore_eos).")
    explain: bool = Field(False, description="Also return `explain`: each prompt token's text, piece, selection "
                                             "score and whether it was recomputed (limits.max_explain_tokens).")


class QueryResponse(BaseModel):
    answer: str
    sources: list[Source]
    stats: QueryStats
    finish_reason: str
    explain: Explain | None = Field(None, description="Present when the request set `explain: true`.")


# ---- /v1/chat/completions (OpenAI) -------------------------------------------------------------

class TextPart(OpenAIBody):
    type: Text
    text: Text | None = None


class FunctionCall(OpenAIBody):
    name: Annotated[str, Field(min_length=1, max_length=256, pattern=ONE_LINE_NOT_BLANK)]
    arguments: Text = Field(description="The call's arguments, as the model wrote them (JSON text).")


class ToolCall(OpenAIBody):
    id: Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS, pattern=ONE_LINE_NOT_BLANK)]
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(OpenAIBody):
    name: Annotated[str, Field(min_length=1, max_length=256, pattern=ONE_LINE_NOT_BLANK)]
    description: Text | None = None
    parameters: dict[str, Any] | None = None


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
     "then": {"properties": {"role": {"const": "assistant"}}}}]}


class ChatMessage(OpenAIBody):
    """A chat message. Every one goes into the prompt, rendered by the model's chat template: tool results
    (role tool, with the `tool_call_id` they answer) and an assistant's `tool_calls` included."""

    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra=_MESSAGE_RULES)

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Text | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="An assistant message's calls.")
    tool_call_id: Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)] | None = Field(
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


class StreamOptions(OpenAIBody):
    include_usage: bool = False


# What `question()` needs, in JSON Schema: a user message whose content (or one of its text parts) is not blank.
_WITH_TEXT = {"type": "string", "pattern": NOT_BLANK}
_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": _WITH_TEXT}}
USER_TEXT = {"type": "object", "required": ["role", "content"], "properties": {
    "role": {"const": "user"}, "content": {"anyOf": [_WITH_TEXT, {"type": "array", "contains": _TEXT_PART}]}}}


def _at_most_4_stops(schema: dict[str, Any]) -> None:
    for branch in schema["anyOf"]:
        if branch.get("type") == "array":
            branch["maxItems"] = 4


class ChatCompletionRequest(OpenAIBody):
    model: Text | None = None
    messages: list[ChatMessage] = Field(min_length=1, json_schema_extra={"contains": USER_TEXT}, description=(
        "The conversation: at least one user message with text; the last such message is the question."))
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    stop: Text | list[Text] | None = Field(None, validate_default=True, json_schema_extra=_at_most_4_stops)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=1, description="Only 1 is supported.")
    user: Text | None = None
    prompt_cache_key: Text | None = Field(None, min_length=1, max_length=MAX_CACHE_KEY_CHARS, description=(
        "The lease family of this request's KV (GET/DELETE /v1/cache?prompt_cache_key=...)."))
    prompt_cache_retention: Literal["in_memory", *RETENTION_TTL_S] | None = Field(  # type: ignore[valid-type]
        None, description="in_memory (the default): the prompt's KV stays under plain LRU; 24h: it is leased for "
                          "24 h (renewed by each hit), see the response's `lease` and x-ragblend-lease header.")
    tools: list[Tool] | None = Field(None, description="Functions the model may call: rendered into the prompt "
                                                      "through the model's chat template.")
    # ragblend extras
    top_k: int | None = Field(None, ge=1)
    mode: Mode = "blend"
    recompute_ratio: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    retrieval: bool | None = Field(None, description=(
        "ragblend extra (the openai client: extra_body): false answers from the messages alone, no passages "
        "retrieved; default true, false under the served name `<model>-chat` (GET /v1/models lists both)."))

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        return [s for s in stops if s]  # an empty stop string would end every answer at once

    def question(self) -> str:
        """The last user message with text (app.conversation lays out the rest of the conversation)."""
        for message in reversed(self.messages):
            if message.role == "user" and message.text().strip():
                return message.text()
        raise LimitError("messages", "needs a user message with text")

    def new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: str
    logprobs: None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens whose KV was read from the store.")
    exact_tokens: int = Field(0, description="ragblend extra: of those, the exact prefix (used as is).")
    recomputed_tokens: int = Field(0, description="ragblend extra: of those, recomputed by the blend (the rest "
                                                  "at new positions was RoPE-shifted and reused).")


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


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None
    logprobs: None = None


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


# ---- /v1/documents -----------------------------------------------------------------------------

class DocumentMeta(StrictBody):
    """What a multipart upload may say about its file's document (the JSON upload says the same)."""

    id: DocId | None = Field(None, description="Default: derived from the text (JSON) or the file name, "
                                               "so re-posting it is a no-op.")
    title: Title | None = None


class DocumentIn(DocumentMeta):
    text: NonBlank = Field(min_length=1)


# A multipart upload's file: its format is its name's suffix, else its part's content type.
UPLOAD_TYPES = {"text/plain": ".txt", "text/markdown": ".md", "application/jsonl": ".jsonl",
                "application/x-ndjson": ".jsonl"}
_FORM_ID = {"type": "string", "minLength": 1, "maxLength": MAX_ID_CHARS, "pattern": ONE_LINE_NOT_BLANK}
UPLOAD_SCHEMA = {
    "schema": {"type": "object", "required": ["file"], "additionalProperties": False, "properties": {
        "file": {"type": "string", "format": "binary", "description": (
            f"UTF-8 text, read as its file name's suffix says ({', '.join(SUFFIXES)}), else as its content type "
            f"says ({', '.join(UPLOAD_TYPES)}); a .jsonl file holds one {{id?, title?, text}} object a line.")},
        "id": {**_FORM_ID, "description": "Document id (default: the file name without its suffix); one line, "
                                          "not blank, no control characters."},
        "title": {"type": "string", "maxLength": MAX_TITLE_CHARS, "pattern": NO_CONTROL_CHARS,
                  "description": "One line, no control characters."}}},
    "encoding": {"file": {"contentType": ", ".join(UPLOAD_TYPES)}}}


@pydantic_dataclass
class IngestedDocument(DocumentInfo):
    status: Literal["added", "updated", "unchanged"]


class IngestResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[IngestedDocument]


class DocumentList(BaseModel):
    object: Literal["list"] = "list"
    data: list[DocumentInfo]


class DeletedDocument(BaseModel):
    id: str
    object: Literal["document"] = "document"
    deleted: bool = True


# ---- limits from settings ----------------------------------------------------------------------

def check_limits(limits: LimitsSettings, *, question: str, top_k: int | None, max_tokens: dict[str, int | None],
                 question_field: str = "question") -> None:
    """Raise LimitError naming the first field over its configured limit (`max_tokens`: each field that
    sets the answer's length, by name)."""
    if len(question) > limits.max_question_chars:
        raise LimitError(question_field, f"at most {limits.max_question_chars} characters "
                                         f"(got {len(question)})")
    if top_k is not None and top_k > limits.max_top_k:
        raise LimitError("top_k", f"at most {limits.max_top_k} (got {top_k})")
    for field, value in max_tokens.items():
        if value is not None and value > limits.max_new_tokens:
            raise LimitError(field, f"at most {limits.max_new_tokens} (got {value})")


def check_budget(limits: LimitsSettings, texts: Sequence[tuple[str, str]], count: Callable[[list[str]], list[int]],
                 total_field: str) -> None:
    """Raise LimitError naming the first (field, text) over `limits.max_message_tokens`, else `total_field`
    when all of them pass `limits.max_prompt_tokens`. `count` gives each text's tokens; a text with more
    characters than a limit's tokens could hold (CHARS_PER_TOKEN_BOUND each) is refused uncounted."""
    per, total = limits.max_message_tokens, limits.max_prompt_tokens
    over = f"over limits.max_message_tokens ({per})"
    for field, text in texts:
        if len(text) > CHARS_PER_TOKEN_BOUND * per:
            raise LimitError(field, f"{len(text):,} characters, {over}")
    if sum(len(text) for _, text in texts) > CHARS_PER_TOKEN_BOUND * total:
        raise LimitError(total_field, f"over limits.max_prompt_tokens ({total}) together")
    counts = count([text for _, text in texts])
    for (field, _), n in zip(texts, counts):
        if n > per:
            raise LimitError(field, f"{n} tokens, {over}")
    if sum(counts) > total:
        raise LimitError(total_field, f"{sum(counts)} tokens together, over limits.max_prompt_tokens ({total})")


# (schema, property) -> (the JSON Schema keyword, the setting) of each limit `check_limits` enforces.
_STATED_LIMITS = {("QueryRequest", "question"): ("maxLength", "max_question_chars"),
                  ("QueryRequest", "top_k"): ("maximum", "max_top_k"),
                  ("QueryRequest", "max_tokens"): ("maximum", "max_new_tokens"),
                  ("ChatCompletionRequest", "top_k"): ("maximum", "max_top_k"),
                  ("ChatCompletionRequest", "max_tokens"): ("maximum", "max_new_tokens"),
                  ("ChatCompletionRequest", "max_completion_tokens"): ("maximum", "max_new_tokens"),
                  ("ChatCompletionRequest", "messages"): ("maxItems", "max_messages"),
                  ("LookupRequest", "messages"): ("maxItems", "max_messages"),
                  ("LookupRequest", "prompt"): ("maxLength", "max_question_chars")}


def state_limits(openapi: dict[str, Any], limits: LimitsSettings) -> None:
    """Write this server's limits into its OpenAPI description: as keywords where JSON Schema can say them,
    the token budgets (tokens are not characters) and the chat question's length in words."""
    schemas = openapi["components"]["schemas"]
    limited = [(model, name, keyword, getattr(limits, setting))
               for (model, name), (keyword, setting) in _STATED_LIMITS.items()]
    # FastAPI's OpenAPI models hold bounds as floats, and 2**63 - 1 rounds up to 2**63: state it exactly.
    limited.append(("ChatCompletionRequest", "seed", "maximum", MAX_SEED))
    for model, name, keyword, value in limited:
        prop = schemas[model]["properties"][name]
        typed = next(s for s in prop.get("anyOf", [prop]) if s.get("type") in ("integer", "string", "array"))
        typed[keyword] = value
    budget = (f"At most {limits.max_message_tokens} tokens a message (limits.max_message_tokens) and "
              f"{limits.max_prompt_tokens} in the whole prompt, passages included (limits.max_prompt_tokens).")
    schemas["QueryRequest"]["properties"]["question"]["description"] = budget
    messages = schemas["ChatCompletionRequest"]["properties"]["messages"]
    messages["description"] += (f" The question has at most {limits.max_question_chars} characters "
                                f"(limits.max_question_chars). {budget}")


def openapi_body(model: type[BaseModel], *, multipart: dict[str, Any] | None = None) -> dict[str, Any]:
    """An `openapi_extra` request body for routes that read the body themselves; `multipart`: the media
    type object (schema and encoding) of a multipart/form-data alternative."""
    content: dict[str, Any] = {"application/json": {"schema": model.model_json_schema()}}
    if multipart:
        content["multipart/form-data"] = multipart
    return {"requestBody": {"required": True, "content": content}}
