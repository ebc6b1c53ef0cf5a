"""Request and response schemas of ragblend's own endpoints (/v1/query, /v1/documents); the OpenAI-compatible
ones are app.api.schemas.openai'.

Static bounds live here (and so in the OpenAPI spec); the limits that come from settings (question
length, top_k, max_tokens: `check_limits`; prompt tokens per message and in all: `check_budget`) give
the same 422 shape, and `state_limits` writes them into the app's OpenAPI description. Every rule the
server enforces is stated there, as a schema keyword where JSON Schema can say it, else in words.
Our own endpoints reject unknown fields; the OpenAI ones ignore them, as OpenAI clients send
fields we have no use for.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass

from app.config import LimitsSettings
from app.engine.conversation import CHARS_PER_TOKEN_BOUND
from app.engine.explain import Explain
from app.engine.ingest import SUFFIXES
from app.engine.query import Mode, QueryStats, Source
from app.validation import (
    MAX_ID_CHARS,
    MAX_TITLE_CHARS,
    NO_CONTROL_CHARS,
    NOT_BLANK,
    ONE_LINE_NOT_BLANK,
    not_blank,
    valid_id,
    valid_title,
    valid_unicode,
)
from blend.selection import POLICIES
from retrieval import DocumentInfo

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
ID_RULE = "One line, not blank; no control, invisible (format) or private-use characters."
# An id the API takes (a document's, a tool call's or tool's, a cache key, a user's): normalised (NFC), and refused
# with characters that would let two ids look alike (app/validation.py)
Id = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS, pattern=ONE_LINE_NOT_BLANK, description=ID_RULE),
               AfterValidator(valid_id)]
CacheKey = Annotated[str, Field(min_length=1, max_length=MAX_CACHE_KEY_CHARS, pattern=ONE_LINE_NOT_BLANK,
                                description=ID_RULE), AfterValidator(partial(valid_id, max_chars=MAX_CACHE_KEY_CHARS))]
DocId = Id
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
# The routes that take a model id: one GET /v1/models does not list is a 404
MODEL_NOT_FOUND = {404: {"model": ErrorResponse, "description": "An unknown model id (code model_not_found): the "
                                                                "`model` enum, GET /v1/models, lists the served ones."}}
DISK_FULL = {507: {"model": ErrorResponse, "headers": RETRY_AFTER,
                   "description": "The data disk is full: nothing was written (code disk_full)."}}
DOCUMENT_ERRORS = {**ERRORS, **DISK_FULL,
                   409: {"model": ErrorResponse,
                         "description": "A different document has that id (and replace is not true)."},
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


# ---- /v1/documents -----------------------------------------------------------------------------

class DocumentMeta(StrictBody):
    """What a multipart upload may say about its file's document (the JSON upload says the same)."""

    id: DocId | None = Field(None, description="Default: derived from the text (JSON) or the file name, "
                                               "so re-posting it is a no-op.")
    title: Title | None = None


class DocumentIn(DocumentMeta):
    text: NonBlank = Field(min_length=1)


# A multipart upload's file: its format is its name's suffix, else its part's content type.
NOT_TEXT = ("Its bytes must be UTF-8 text with no NUL whatever content type its part declares: a binary file (an "
            "image, a PDF) sent as text/plain is a 422 whose message says it is not text.")
UPLOAD_TYPES = {"text/plain": ".txt", "text/markdown": ".md", "application/jsonl": ".jsonl",
                "application/x-ndjson": ".jsonl"}
_FORM_ID = {"type": "string", "minLength": 1, "maxLength": MAX_ID_CHARS, "pattern": ONE_LINE_NOT_BLANK}
UPLOAD_SCHEMA = {
    "schema": {"type": "object", "required": ["file"], "additionalProperties": False, "properties": {
        "file": {"type": "string", "format": "binary", "description": (
            f"UTF-8 text, read as its file name's suffix says ({', '.join(SUFFIXES)}), else as its content type "
            f"says ({', '.join(UPLOAD_TYPES)}); a .jsonl file holds one {{id?, title?, text}} object a line. "
            f"{NOT_TEXT}")},
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
    # The prompt's work, priced before any is done: its tokens (each as computed: what the store holds is not
    # known yet), and each message as a piece (its render, its store key, read and write) at
    # limits.piece_cost_tokens more: many tiny messages cost what their work does
    price = limits.price(computed=sum(counts), read=0, pieces=len(texts))
    if price > total:
        raise LimitError(total_field, f"{sum(counts)} tokens in {len(texts)} messages, priced at {price} (each message "
                                      f"{limits.piece_cost_tokens} tokens more, limits.piece_cost_tokens), over "
                                      f"limits.max_prompt_tokens ({total})")


# (schema, property) -> (the JSON Schema keyword, the setting) of each limit `check_limits` enforces.
_STATED_LIMITS = {("QueryRequest", "question"): ("maxLength", "max_question_chars"),
                  ("QueryRequest", "top_k"): ("maximum", "max_top_k"),
                  ("QueryRequest", "max_tokens"): ("maximum", "max_new_tokens"),
                  ("ChatCompletionRequest", "top_k"): ("maximum", "max_top_k"),
                  ("ChatCompletionRequest", "max_tokens"): ("maximum", "max_new_tokens"),
                  ("ChatCompletionRequest", "max_completion_tokens"): ("maximum", "max_new_tokens"),
                  ("ChatCompletionRequest", "messages"): ("maxItems", "max_messages"),
                  ("LookupRequest", "messages"): ("maxItems", "max_messages"),
                  ("LookupRequest", "top_k"): ("maximum", "max_top_k"),
                  ("LookupRequest", "max_tokens"): ("maximum", "max_new_tokens"),
                  ("LookupRequest", "max_completion_tokens"): ("maximum", "max_new_tokens"),
                  ("CompletionRequest", "max_tokens"): ("maximum", "max_new_tokens"),
                  ("LookupRequest", "prompt"): ("maxLength", "max_question_chars")}


def state_limits(openapi: dict[str, Any], limits: LimitsSettings) -> None:
    """Write this server's limits into its OpenAPI description: as keywords where JSON Schema can say them,
    the token budgets (tokens are not characters) and the chat question's length in words."""
    schemas = openapi["components"]["schemas"]
    limited = [(model, name, keyword, getattr(limits, setting))
               for (model, name), (keyword, setting) in _STATED_LIMITS.items()]
    # FastAPI's OpenAPI models hold bounds as floats, and 2**63 - 1 rounds up to 2**63: state it exactly.
    limited += [(model, "seed", "maximum", MAX_SEED) for model in ("ChatCompletionRequest", "LookupRequest",
                                                                         "CompletionRequest")]
    for model, name, keyword, value in limited:
        prop = schemas[model]["properties"][name]
        typed = next(s for s in prop.get("anyOf", [prop]) if s.get("type") in ("integer", "string", "array"))
        typed[keyword] = value
    budget = (f"At most {limits.max_message_tokens} tokens a message (limits.max_message_tokens) and "
              f"{limits.max_prompt_tokens} in the whole prompt, passages included (limits.max_prompt_tokens); "
              f"each message is priced at {limits.piece_cost_tokens} tokens more (limits.piece_cost_tokens), its "
              f"work as a piece of the prompt, within the same budget. Once the store is looked up, before any KV is "
              f"read or any layer runs, the exact price is checked against the same budget (else a 400): tokens "
              f"computed, tokens whose KV is read from the store at {limits.read_token_cost} of a computed token "
              f"each (limits.read_token_cost), and each message and retrieved passage as a piece.")
    schemas["QueryRequest"]["properties"]["question"]["description"] = budget
    messages = schemas["ChatCompletionRequest"]["properties"]["messages"]
    messages["description"] += (f" The question has at most {limits.max_question_chars} characters "
                                f"(limits.max_question_chars). {budget}")


def state_models(openapi: dict[str, Any], names: list[str], embedder: str) -> None:
    """The served model ids as the `model` enum of each request body that names one (another id is a 404), the
    embedder's id that of /v1/embeddings'."""
    schemas = openapi["components"]["schemas"]
    schemas["EmbeddingRequest"]["properties"]["model"]["enum"] = [embedder]
    props = [schemas[name]["properties"]["model"] for name in ("ChatCompletionRequest", "LookupRequest",
                                                               "CompletionRequest")]
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        body = openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        props.append(body["properties"]["model"])
    for prop in props:
        next(s for s in prop.get("anyOf", [prop]) if s.get("type") == "string")["enum"] = names


def state_sizes(openapi: dict[str, Any], vocab: int, dimensions: int) -> None:
    """The loaded model's sizes: /v1/completions' token ids below its vocabulary, /v1/embeddings' `dimensions`
    the embedder's own."""
    schemas = openapi["components"]["schemas"]
    ids = next(s for s in schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
               if s.get("type") == "array" and s["items"].get("type") == "integer")
    ids["items"]["maximum"] = vocab - 1
    dims = schemas["EmbeddingRequest"]["properties"]["dimensions"]
    next(s for s in dims.get("anyOf", [dims]) if s.get("type") == "integer")["enum"] = [dimensions]


def openapi_body(model: type[BaseModel], *, multipart: dict[str, Any] | None = None,
                 description: str | None = None) -> dict[str, Any]:
    """An `openapi_extra` request body for routes that read the body themselves; `multipart`: the media
    type object (schema and encoding) of a multipart/form-data alternative."""
    content: dict[str, Any] = {"application/json": {"schema": model.model_json_schema()}}
    if multipart:
        content["multipart/form-data"] = multipart
    return {"requestBody": {"required": True, "content": content} | ({"description": description} if description
                                                                     else {})}
