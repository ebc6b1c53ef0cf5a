"""Request and response schemas of the HTTP API: ragblend's own (/v1/query, /v1/documents) and
the OpenAI-compatible chat completions.

Static bounds live here (and so in the OpenAPI spec); the limits that come from settings
(question length, top_k, max_tokens) are checked by `check_limits`, with the same 422 shape.
Our own endpoints reject unknown fields; the OpenAI ones ignore them, as OpenAI clients send
fields we have no use for.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass

from app.config import LimitsSettings
from app.engine import Mode, QueryStats, Source
from app.validation import (MAX_ID_CHARS, MAX_TITLE_CHARS, NO_CONTROL_CHARS, not_blank, valid_doc_id,
                            valid_title, valid_unicode)
from app.explain import Explain
from retrieval import DocumentInfo
from blend.selection import POLICIES, get_policy

MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed's range


class LimitError(ValueError):
    """A field over a configured limit (HTTP 422, naming the field)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


# Every string a client sends is valid Unicode (app/validation.py has the rules); ids and titles carry
# their rules in the schema too, so the OpenAPI spec documents them.
Text = Annotated[str, AfterValidator(valid_unicode)]
NonBlank = Annotated[str, AfterValidator(not_blank), AfterValidator(valid_unicode)]
DocId = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS, pattern=NO_CONTROL_CHARS,
                             description="One line, no control characters."), AfterValidator(valid_doc_id)]
Title = Annotated[str, Field(max_length=MAX_TITLE_CHARS, pattern=NO_CONTROL_CHARS,
                             description="One line, no control characters."), AfterValidator(valid_title)]


class StrictBody(BaseModel):
    """A request body: strict types (no true for 1, no "yes" for true); unknown fields refused."""

    model_config = ConfigDict(strict=True, extra="forbid")


class OpenAIBody(BaseModel):
    """An OpenAI-shaped request: strict types, but unknown fields ignored (clients send many)."""

    model_config = ConfigDict(strict=True, extra="ignore")


# ---- errors ------------------------------------------------------------------------------------

class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str = Field(description="Machine-readable reason, e.g. invalid_value, queue_full.")
    param: str | None = Field(None, description="The request field at fault, when one is.")


class ErrorResponse(BaseModel):
    error: ErrorDetail


# The error responses a route documents in the OpenAPI schema.
ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (400, 401, 413, 422, 429, 503)}


# ---- /v1/query ---------------------------------------------------------------------------------

class QueryRequest(StrictBody):
    question: NonBlank = Field(min_length=1)
    top_k: int | None = Field(None, ge=1, description="Passages to retrieve (default: retrieval.top_k).")
    mode: Mode = Field("blend", description="blend: cached chunk KV + selective recompute; full: plain "
                                            "prefill; reuse: cached chunk KV, nothing recomputed.")
    recompute_ratio: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False,
                                          description="Share of cached tokens recomputed (default: blend.ratio).")
    selection: str | None = Field(None, description="Selection policy of the tokens to recompute, one of "
                                                    f"{', '.join(sorted(POLICIES))} (default: blend.selection).")
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=2.0, allow_inf_nan=False)
    stream: bool = False
    ignore_eos: bool = Field(False, description="Generate max_tokens tokens whatever the model says "
                                                "(for benchmarks, as vLLM's ignore_eos).")
    explain: bool = Field(False, description="Also return `explain`: each prompt token's text, piece, selection "
                                             "score and whether it was recomputed (limits.max_explain_tokens).")

    @field_validator("selection")
    @classmethod
    def _known_policy(cls, value: str | None) -> str | None:
        return None if value is None else get_policy(value).name


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


class ChatMessage(OpenAIBody):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Text | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: keep the text ones
            return "\n".join(p.text for p in self.content if p.type == "text" and p.text)
        return self.content or ""


class StreamOptions(OpenAIBody):
    include_usage: bool = False


class ChatCompletionRequest(OpenAIBody):
    model: Text | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    stop: Text | list[Text] | None = Field(None, validate_default=True)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=1, description="Only 1 is supported.")
    user: Text | None = None
    # ragblend extras
    top_k: int | None = Field(None, ge=1)
    mode: Mode = "blend"
    recompute_ratio: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)

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
    cached_tokens: int


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

def check_limits(limits: LimitsSettings, *, question: str, top_k: int | None, max_tokens: int | None,
                 question_field: str = "question", max_tokens_field: str = "max_tokens") -> None:
    """Raise LimitError naming the first field over its configured limit."""
    if len(question) > limits.max_question_chars:
        raise LimitError(question_field, f"at most {limits.max_question_chars} characters "
                                         f"(got {len(question)})")
    if top_k is not None and top_k > limits.max_top_k:
        raise LimitError("top_k", f"at most {limits.max_top_k} (got {top_k})")
    if max_tokens is not None and max_tokens > limits.max_new_tokens:
        raise LimitError(max_tokens_field, f"at most {limits.max_new_tokens} (got {max_tokens})")


def openapi_body(model: type[BaseModel], *, multipart: dict[str, Any] | None = None) -> dict[str, Any]:
    """An `openapi_extra` request body for routes that read the body themselves."""
    content: dict[str, Any] = {"application/json": {"schema": model.model_json_schema()}}
    if multipart:
        content["multipart/form-data"] = {"schema": multipart}
    return {"requestBody": {"required": True, "content": content}}
