"""OpenAI's embeddings, POST /v1/embeddings: the vectors of this server's retrieval embedder (all-MiniLM-L6-v2 by
default; float32, unit norm), for a client that does its own retrieval and wants the same vectors this server's
index holds. Text only: token ids are a 400 (they would be another tokenizer's); a text longer than the embedder
reads is a 400 rather than silently cut, unless the request asks for the cut (vLLM's `truncate_prompt_tokens`);
`dimensions` is the embedder's own. `encoding_format` base64 (the official client's default) is the float32
vector's little-endian bytes.

Bounded as prompts are: a request is priced (its word pieces, each text a piece at limits.piece_cost_tokens) and
refused over limits.max_embedding_tokens (422); a tenant's requests in flight together over
limits.max_tenant_embedding_tokens are a 429. They run on the ingest lane (never the model thread) a slice of
embedder.batch_size texts a job, each request handing over its next slice once the last is done: concurrent
requests and uploads take turns, so an upload waits for one slice per request in flight, not for whole requests."""
from __future__ import annotations

import asyncio
import base64
from typing import Annotated, Literal

import numpy as np
from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field, WithJsonSchema

from app.api.deps import on_lane, service
from app.api.errors import ApiError
from app.api.schemas.ragblend import ERRORS, MODEL_NOT_FOUND, LimitError, OpenAIBody, Text
from app.serving.service import Service

router = APIRouter()
MAX_INPUTS = 256  # texts in one request
InputText = Annotated[Text, Field(min_length=1)]
Texts = Annotated[list[InputText], Field(min_length=1, max_length=MAX_INPUTS)]
TokenIds = list[int]


class EmbeddingRequest(OpenAIBody):
    model: Text = Field(description="The embedder's id (the last GET /v1/models lists; another is a 404).")
    # token ids are taken here only to be refused with a 400 that says why (the schema states text alone)
    input: Annotated[InputText | Texts | TokenIds | list[TokenIds], WithJsonSchema(
        {"anyOf": [{"type": "string", "minLength": 1}, {"type": "array", "items": {"type": "string", "minLength": 1},
                                                        "minItems": 1, "maxItems": MAX_INPUTS}]})] = Field(
        description=f"A text or up to {MAX_INPUTS} texts, each within the embedder's window (a longer one is a "
                    "400 unless truncate_prompt_tokens asks for the cut). Token ids are a 400: they would be another "
                    "tokenizer's. Priced as a prompt: its word pieces plus limits.piece_cost_tokens a text, at most "
                    "limits.max_embedding_tokens (422).")
    encoding_format: Literal["float", "base64"] = Field("float", description="base64: little-endian float32 bytes.")
    dimensions: int | None = Field(None, ge=1, description="Only the embedder's own (384 for all-MiniLM-L6-v2).")
    truncate_prompt_tokens: int | None = Field(None, ge=-1, description=(
        "vLLM's: each text cut after this many word pieces (-1 or 0: the embedder's whole window; more than the "
        "window reads is cut to the window). Without it a longer text is a 400."))
    user: Text | None = None


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


@router.post("/v1/embeddings", response_model=EmbeddingList, responses={**ERRORS, **MODEL_NOT_FOUND})
async def embeddings(body: EmbeddingRequest, request: Request, svc: Service = Depends(service)) -> EmbeddingList:
    """Each input's vector, in order (see the module docstring)."""
    embedder = svc.serving.embedder
    if body.model != embedder.name:
        raise ApiError(404, f"The model {body.model!r} does not exist: this server embeds with {embedder.name!r}",
                       code="model_not_found", param="model")
    texts = [body.input] if isinstance(body.input, str) else body.input
    if not texts:  # (an empty list validates as token ids)
        raise ApiError(422, "input: at least one text", "invalid_value", param="input")
    if not all(isinstance(text, str) for text in texts):
        raise ApiError(400, "input: token ids are not served (they would be another tokenizer's); send text",
                       param="input")
    if body.dimensions is not None and body.dimensions != embedder.dim:
        raise ApiError(400, f"dimensions: {embedder.name} embeds in {embedder.dim} dimensions only",
                       param="dimensions")
    if body.truncate_prompt_tokens is not None:
        cut = min(body.truncate_prompt_tokens, embedder.window) if body.truncate_prompt_tokens > 0 else embedder.window
        texts = await asyncio.to_thread(embedder.truncate, texts, cut)
    counts = await asyncio.to_thread(embedder.count_tokens, texts)
    over = next((i for i, n in enumerate(counts) if n > embedder.window), None)
    if over is not None:
        raise ApiError(400, f"input[{over}]: {counts[over]} word pieces, over the {embedder.window} {embedder.name} "
                            f"reads; cut it shorter, or ask the server to: truncate_prompt_tokens: -1 (the first "
                            f"{embedder.window}) or a smaller count", param="input")
    limits = svc.settings.limits
    price = sum(counts) + limits.piece_cost_tokens * len(texts)
    if price > limits.max_embedding_tokens:
        raise LimitError("input", f"{sum(counts)} word pieces in {len(texts)} texts, priced at {price} (each text "
                                  f"{limits.piece_cost_tokens} more, limits.piece_cost_tokens), over "
                                  f"limits.max_embedding_tokens ({limits.max_embedding_tokens})")
    with svc.embedding_share(price):
        vectors = np.concatenate([  # [len(texts), dim] float32, a slice a job: concurrent requests take turns,
            # uploads and deletes first
            await on_lane(request, svc, lambda _, part=texts[i:i + embedder.batch_size]: embedder.embed(part),
                          "embed", yields=True)
            for i in range(0, len(texts), embedder.batch_size)])
    data = [Embedding(index=i, embedding=encoded(v, body.encoding_format)) for i, v in enumerate(vectors)]
    return EmbeddingList(data=data, model=embedder.name,
                         usage=EmbeddingUsage(prompt_tokens=sum(counts), total_tokens=sum(counts)))


def encoded(vector: np.ndarray, encoding: str) -> list[float] | str:
    """[dim] float32 as a list of floats, or base64 of its little-endian bytes."""
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
