"""The document routes: list, get and delete documents, and uploads (JSON `{id?, title?, text}` or a
multipart .txt/.md/.jsonl file, read by the same code as `ragblend ingest`). Uploads and deletes run
on the ingest lane, one at a time, through the Serving's upload Ingestor."""
from __future__ import annotations

import hashlib
import json
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from app.api_models import (ERRORS, DeletedDocument, DocumentIn, DocumentList, DocumentMeta, ErrorResponse,
                            IngestedDocument, IngestResponse, LimitError, openapi_body)
from app.components import Serving
from app.errors import ApiError
from app.ingest import SUFFIXES, SourceDocument, read_documents
from app.service import Service, service, serving
from retrieval import DocumentInfo, Retriever

router = APIRouter()


UPLOAD_SCHEMA = {"type": "object", "required": ["file"], "properties": {
    "file": {"type": "string", "format": "binary", "description": f"One of {', '.join(SUFFIXES)}"},
    "id": {"type": "string", "description": "Document id (default: the file name without extension)."},
    "title": {"type": "string"}}}


@router.post("/v1/documents", status_code=201, response_model=IngestResponse, responses=ERRORS,
             openapi_extra=openapi_body(DocumentIn, multipart=UPLOAD_SCHEMA))
async def add_document(request: Request, svc: Service = Depends(service),
                       parts: Serving = Depends(serving)) -> IngestResponse:
    """Ingest JSON `{id?, title?, text}` or a multipart `file` (.txt, .md, .jsonl) like `ragblend ingest`."""
    content_type = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if content_type == "multipart/form-data":
        docs = await _uploaded_documents(request)
    elif content_type == "application/json":
        docs = [_json_document(await request.body())]
    else:
        raise ApiError(415, f"unsupported content type {content_type!r}: send application/json or "
                            f"multipart/form-data", "unsupported_media_type")
    return IngestResponse(data=await svc.on_lane(request, lambda cancelled: _ingest(parts, docs, cancelled),
                                                 f"upload of {len(docs)} document(s)"))


def _json_document(body: bytes) -> SourceDocument:
    """The JSON upload, parsed and validated as FastAPI does for the other routes."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ApiError(422, f"body: invalid JSON ({'nested too deeply' if isinstance(exc, RecursionError) else exc})",
                       "invalid_body", "body") from None
    try:
        doc = DocumentIn.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
    doc_id = doc.id or "doc-" + hashlib.sha256(doc.text.encode()).hexdigest()[:16]
    return SourceDocument(doc_id, doc.title, doc.text, "api")


async def _uploaded_documents(request: Request) -> list[SourceDocument]:
    """The documents in an uploaded file, read by the same code as `ragblend ingest`; the form's id and
    title pass the same checks as a JSON upload's."""
    form = await request.form()
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise LimitError("file", "a multipart file field named 'file' is required")
    fields = {name: form.get(name) for name in ("id", "title") if form.get(name) is not None}
    try:
        meta = DocumentMeta.model_validate(fields)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
    doc_id, title = meta.id, meta.title
    name = Path(upload.filename or "").name
    if Path(name).suffix.lower() not in SUFFIXES:
        raise LimitError("file", f"unsupported file {name!r}: use {', '.join(SUFFIXES)}")
    data = await upload.read()
    with tempfile.TemporaryDirectory(prefix="ragblend-upload-") as tmp:
        path = Path(tmp) / name
        path.write_bytes(data)
        docs, errors = read_documents(path, str(doc_id).strip() if doc_id else path.stem)
    if errors:
        raise LimitError("file", "; ".join(errors[:5]).replace(tmp + "/", ""))
    ids = [d.doc_id for d in docs]
    if len(set(ids)) != len(ids):
        raise LimitError("file", "duplicate document ids in the file")
    if not docs:
        raise LimitError("file", "the file holds no documents")
    for doc in docs:
        doc.source = doc.source.replace(tmp + "/", "upload:")
        if title and len(docs) == 1:
            doc.title = str(title)
    return docs


def _ingest(parts: Serving, docs: list[SourceDocument], cancelled: Callable[[], bool]) -> list[IngestedDocument]:
    """On the ingest lane: chunk all first (bad input fails before anything is written) and embed here,
    precompute each chunk's KV on the model thread (one task per chunk, between other requests' work),
    then commit all or none. Cancelled (client gone, shutdown) between two embedding batches or chunks."""
    results = parts.uploads.ingest(docs, cancelled)
    return [IngestedDocument(**asdict(_document(parts.retriever, r.doc_id)), status=r.status) for r in results]


def _document(retriever: Retriever, doc_id: str) -> DocumentInfo:
    info = retriever.get_document(doc_id)
    if info is None:
        raise ApiError(404, f"no document {doc_id!r}", "not_found", "doc_id")
    return info


@router.get("/v1/documents", response_model=DocumentList, responses=ERRORS)
def list_documents(parts: Serving = Depends(serving)) -> DocumentList:
    return DocumentList(data=parts.retriever.list_documents())


@router.get("/v1/documents/{doc_id:path}", response_model=DocumentInfo, responses={404: {"model": ErrorResponse}})
def get_document(doc_id: str, parts: Serving = Depends(serving)) -> DocumentInfo:
    return _document(parts.retriever, doc_id)


@router.delete("/v1/documents/{doc_id:path}", response_model=DeletedDocument,
               responses={404: {"model": ErrorResponse}, **ERRORS})
async def delete_document(doc_id: str, request: Request, svc: Service = Depends(service),
                          parts: Serving = Depends(serving)) -> DeletedDocument:
    def delete(cancelled: Callable[[], bool]) -> DeletedDocument:
        try:
            parts.uploads.delete(doc_id)
        except KeyError:
            raise ApiError(404, f"no document {doc_id!r}", "not_found", "doc_id") from None
        return DeletedDocument(id=doc_id)
    return await svc.on_lane(request, delete, f"delete {doc_id[:60]}")
