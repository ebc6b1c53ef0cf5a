"""The document routes: list, get and delete documents, and uploads (JSON `{id?, title?, text}` or a
multipart .txt/.md/.jsonl file, read by the same code as `ragblend ingest`). Uploads and deletes run
on the ingest lane, one at a time, through the Serving's upload Ingestor.

An upload never replaces a different document unless it says so (`?replace=true`): otherwise a taken
id is a 409 and nothing is written. Every text of a multipart form (field names and values, the file
name) must be UTF-8, as a JSON body must: Starlette's own parser would read other bytes as Latin-1.

Collections (retrieval.documents): "shared", one collection every tenant sees; "tenant", each tenant (its API
key's, server.api_keys; the default tenant too) uploads to, lists, gets and deletes its own collection only.
Another tenant's document is a 404 like one that does not exist, and its id is free in this tenant's.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import unicodedata
from contextlib import aclosing
from dataclasses import asdict
from pathlib import PurePosixPath
from typing import Callable

from fastapi import APIRouter, Depends, Query, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException, MultiPartParser, parse_options_header

from app.api.deps import on_lane, service, serving
from app.api.errors import ApiError
from app.api.schemas.ragblend import (
    DISK_FULL,
    DOCUMENT_ERRORS,
    ERRORS,
    NOT_TEXT,
    UPLOAD_SCHEMA,
    UPLOAD_TYPES,
    DeletedDocument,
    DocumentIn,
    DocumentList,
    DocumentMeta,
    ErrorResponse,
    IngestedDocument,
    IngestResponse,
    LimitError,
    openapi_body,
)
from app.engine.ingest import SUFFIXES, SourceDocument, parse_documents
from app.serving.parts import Serving
from app.serving.service import Service
from app.tenants import current_tenant
from retrieval import DocumentInfo, Retriever

router = APIRouter()
REPLACE = Query(False, description="Replace a different document that has the same id. Without it such an "
                                   "upload is a 409 and changes nothing; the same document again is `unchanged`.")


def collection(svc: Service = Depends(service)) -> str:
    """The collection the caller's requests see: its tenant's, or the shared one ("")."""
    return svc.settings.retrieval.collection(current_tenant().name)


@router.post("/v1/documents", status_code=201, response_model=IngestResponse, responses=DOCUMENT_ERRORS,
             openapi_extra=openapi_body(DocumentIn, multipart=UPLOAD_SCHEMA, description=(
                 "A JSON document, or a multipart form with one `file` (.txt, .md, .jsonl). " + NOT_TEXT)))
async def add_document(request: Request, replace: bool = REPLACE, svc: Service = Depends(service),
                       parts: Serving = Depends(serving), scope: str = Depends(collection)) -> IngestResponse:
    """Ingest JSON `{id?, title?, text}` or a multipart `file` (.txt, .md, .jsonl) like `ragblend ingest`, into the
    caller's collection: with `retrieval.documents: tenant` its tenant's own (an id another tenant uses is free
    here), else the one shared collection."""
    content_type = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if content_type == "multipart/form-data":
        docs = await _uploaded_documents(request)
    elif content_type == "application/json":
        docs = [_json_document(await request.body())]
    else:
        raise ApiError(415, f"unsupported content type {content_type!r}: send application/json or "
                            f"multipart/form-data", "unsupported_media_type")
    def ingest(cancelled):
        return _ingest(parts, docs, cancelled, replace, scope)

    return IngestResponse(data=await on_lane(request, svc, ingest, "upload"))


def _json_document(body: bytes) -> SourceDocument:
    """The JSON upload, parsed and validated as FastAPI does for the other routes."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ApiError(422, f"body: invalid JSON ({'nested too deeply' if isinstance(exc, RecursionError) else exc})",
                       "invalid_body", "body") from None
    doc = _validated(DocumentIn, data)
    doc_id = doc.id or "doc-" + hashlib.sha256(doc.text.encode()).hexdigest()[:16]
    return SourceDocument(doc_id, doc.title, doc.text, "api")


def _validated(model: type[DocumentMeta], data: object) -> DocumentMeta:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None


async def _uploaded_documents(request: Request) -> list[SourceDocument]:
    """The documents in an uploaded file, read by the same code as `ragblend ingest`; the form's id and
    title pass the same checks as a JSON upload's."""
    form = await _utf8_form(request)
    try:
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise LimitError("file", "a multipart file field named 'file' is required")
        meta = _validated(DocumentMeta, {name: form.get(name) for name in ("id", "title") if name in form})
        name = PurePosixPath((upload.filename or "").replace("\\", "/")).name
        suffix, stem = _upload_format(name, upload.content_type)
        docs, errors = parse_documents(await upload.read(), suffix, stem, meta.id.strip() if meta.id else stem,
                                       f"upload:{name}")
    finally:
        await form.close()
    if errors:
        raise LimitError("file", "; ".join(errors[:5]))
    ids = [d.doc_id for d in docs]
    if len(set(ids)) != len(ids):
        raise LimitError("file", "duplicate document ids in the file")
    if not docs:
        raise LimitError("file", "the file holds no documents")
    if meta.title and len(docs) == 1:
        docs[0].title = meta.title
    return docs


def _upload_format(name: str, content_type: str | None) -> tuple[str, str]:
    """(suffix, stem) of an uploaded file: its name's suffix when that is .txt, .md or .jsonl (the stem is
    then the name without it), else the one its part's Content-Type names (the stem is the whole name)."""
    suffix = PurePosixPath(name).suffix.lower()
    if suffix in SUFFIXES:
        return suffix, name[:-len(suffix)]
    media_type = (content_type or "").split(";")[0].strip().lower()
    if media_type in UPLOAD_TYPES:
        return UPLOAD_TYPES[media_type], name
    raise LimitError("file", f"unsupported file {name!r} ({media_type or 'no content type'}): name it "
                             f"{', '.join(SUFFIXES)} or send it as {', '.join(UPLOAD_TYPES)}")


class Utf8MultiPartParser(MultiPartParser):
    """Starlette's multipart parser, refusing a field name, file name or field value that is not UTF-8."""

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self._current_part.content_disposition)
        for key in (b"name", b"filename"):
            _check_utf8(options.get(key, b""), "file" if key == b"filename" else "body",
                        "file name" if key == b"filename" else "field name")
        super().on_headers_finished()

    def on_part_end(self) -> None:
        if self._current_part.file is None:
            _check_utf8(self._current_part.data, self._current_part.field_name, "field's value")
        super().on_part_end()


def _check_utf8(data: bytes | bytearray, param: str, what: str) -> None:
    try:
        bytes(data).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LimitError(param, f"the {what} is not UTF-8 (invalid byte at offset {exc.start})") from None


async def _utf8_form(request: Request) -> FormData:
    """The multipart form, parsed with Utf8MultiPartParser: one file and a few fields."""
    try:
        async with aclosing(request.stream()) as stream:
            return await Utf8MultiPartParser(request.headers, stream, max_files=1, max_fields=16).parse()
    except MultiPartException as exc:  # as Starlette's request.form() reports it
        raise HTTPException(400, detail=exc.message) from None


def _ingest(parts: Serving, docs: list[SourceDocument], cancelled: Callable[[], bool],
            replace: bool, scope: str) -> list[IngestedDocument]:
    """On the ingest lane: chunk all first (bad input fails before anything is written) and embed here,
    precompute each chunk's KV on the model thread (one task per chunk, between other requests' work),
    then commit all or none. Cancelled (client gone, shutdown) between two embedding batches or chunks."""
    results = dataclasses.replace(parts.uploads, collection=scope).ingest(docs, cancelled, replace=replace)
    return [IngestedDocument(**asdict(_document(parts.retriever, r.doc_id, scope)), status=r.status) for r in results]


def _document(retriever: Retriever, doc_id: str, scope: str) -> DocumentInfo:
    info = retriever.get_document(doc_id, scope)
    if info is None:
        raise ApiError(404, f"no document {doc_id!r}", "not_found", "doc_id")
    return info


@router.get("/v1/documents", response_model=DocumentList, responses=ERRORS)
def list_documents(parts: Serving = Depends(serving), scope: str = Depends(collection)) -> DocumentList:
    """The documents of the caller's collection: its tenant's own with `retrieval.documents: tenant`, else the
    shared one."""
    return DocumentList(data=parts.retriever.list_documents(scope))


@router.get("/v1/documents/{doc_id:path}", response_model=DocumentInfo,
            responses={404: {"model": ErrorResponse}, **ERRORS})
def get_document(doc_id: str, parts: Serving = Depends(serving), scope: str = Depends(collection)) -> DocumentInfo:
    """A document of the caller's collection; with `retrieval.documents: tenant` another tenant's is a 404."""
    return _document(parts.retriever, unicodedata.normalize("NFC", doc_id), scope)


@router.delete("/v1/documents/{doc_id:path}", response_model=DeletedDocument,
               responses={404: {"model": ErrorResponse}, **ERRORS, **DISK_FULL})
async def delete_document(doc_id: str, request: Request, svc: Service = Depends(service),
                          parts: Serving = Depends(serving), scope: str = Depends(collection)) -> DeletedDocument:
    """Delete a document of the caller's collection, its index entries and its chunks' KV; with
    `retrieval.documents: tenant` another tenant's is a 404."""
    doc_id = unicodedata.normalize("NFC", doc_id)  # ids are stored in NFC

    def delete(cancelled: Callable[[], bool]) -> DeletedDocument:
        try:
            dataclasses.replace(parts.uploads, collection=scope).delete(doc_id)
        except KeyError:
            raise ApiError(404, f"no document {doc_id!r}", "not_found", "doc_id") from None
        return DeletedDocument(id=doc_id)
    return await on_lane(request, svc, delete, "delete")
