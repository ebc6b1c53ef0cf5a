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

from app.config import LimitsSettings
from app.engine import Mode
from blend.selection import POLICIES, get_policy

MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed's range


class LimitError(ValueError):
    """A field over a configured limit (HTTP 422, naming the field)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


def _not_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be empty or whitespace")
    return value


NonBlank = Annotated[str, AfterValidator(_not_blank)]


# ---- errors ------------------------------------------------------------------------------------

class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str | None = None
    param: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# ---- /v1/query ---------------------------------------------------------------------------------

class QueryRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

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

    @field_validator("selection")
    @classmethod
    def _known_policy(cls, value: str | None) -> str | None:
        return None if value is None else get_policy(value).name


class SourceOut(BaseModel):
    doc_id: str
    chunk_id: int
    title: str | None
    score: float
    text: str


class StatsOut(BaseModel):
    mode: str
    ttft_ms: float
    total_ms: float
    queue_ms: float = 0.0
    retrieve_ms: float
    kv_load_ms: float
    prefill_ms: float
    prompt_tokens: int
    cached_tokens: int
    recomputed_tokens: int
    recompute_ratio: float
    selection: str | None = Field(None, description="The selection policy a blend ran with.")
    completion_tokens: int
    store_hits: dict[str, int] = Field(description='Chunks per tier they came from; "computed" = store miss.')
    fallback: str | None = None


class QueryResponse(BaseModel):
    answer: str
    sources: list[SourceOut]
    stats: StatsOut
    finish_reason: str


# ---- /v1/chat/completions (OpenAI) -------------------------------------------------------------

class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: keep the text ones
            return "\n".join(p.text for p in self.content if p.type == "text" and p.text)
        return self.content or ""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    stop: str | list[str] | None = Field(None, validate_default=True)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=1, description="Only 1 is supported.")
    user: str | None = None
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
        """Retrieval and the answer use the last user message; earlier turns are not replayed."""
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
    sources: list[SourceOut] = Field(default_factory=list, description="ragblend extra: the retrieved passages.")


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


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ragblend"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---- /v1/documents -----------------------------------------------------------------------------

class DocumentIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: NonBlank | None = Field(None, min_length=1, max_length=256, pattern=r"^[^\x00-\x1f\x7f]+$",
                                description="No control characters. Default: derived from the text, so "
                                            "re-posting it is a no-op.")
    title: str | None = Field(None, max_length=1024)
    text: NonBlank = Field(min_length=1)


class DocumentOut(BaseModel):
    id: str
    object: Literal["document"] = "document"
    title: str | None
    source: str | None
    n_chunks: int
    content_hash: str
    ingested_at: float


class IngestedDocument(DocumentOut):
    status: Literal["added", "updated", "unchanged"]


class IngestResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[IngestedDocument]


class DocumentList(BaseModel):
    object: Literal["list"] = "list"
    data: list[DocumentOut]


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
