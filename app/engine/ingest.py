"""Ingest: files → documents → chunks → embeddings + precomputed chunk KV → metadata + index.

Inputs: .txt, .md and .jsonl files, and folders searched recursively (sorted; hidden entries and
other extensions skipped). Each JSONL line is one `{"id"?, "title"?, "text"}` object.

Document ids, stable across runs:
- a file named directly: its stem             (`corpus/harbor.md` → "harbor");
- a file found in a folder: its path relative to that folder, without extension, "/"-separated
                                              (`corpus` holding `recipes/bread.md` → "recipes/bread");
- a JSONL line: its "id", else "<file id>:<line number>".
Titles: the JSONL "title"; else, for .md, the first heading (dropped from the text when it is the
first line, since the prompt shows the title anyway); else the file stem.

Per document (`Ingestor`): chunk; skip it if nothing changed (same text, title, chunks and KV
keys: a new model or prompt changes the keys, so re-ingesting recomputes the KV); embed and
precompute each chunk's KV (`precompute_at="first_use"`: only record its key; the first query
that retrieves the chunk computes and stores it); then commit metadata + index in one step
(retrieval.Retriever) and drop the KV entries of replaced chunks. A failure before the commit
leaves the previous version in place and deletes the KV entries written for the failed one.

An Ingestor writes to one collection (`collection`: "" the shared one, or a tenant's under
retrieval.documents: tenant): its ids, and its chunks' KV keys (app.engine.kv), are that collection's.
"""
from __future__ import annotations

import json
import logging
import re
import time
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import numpy as np

from app.validation import valid_doc_id, valid_title, valid_unicode
from retrieval import Chunk, Chunker, DocumentInfo, Retriever
from retrieval.chunker import sha256_text

log = logging.getLogger("ragblend.ingest")

SUFFIXES = (".txt", ".md", ".jsonl")
_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)


class IngestError(ValueError):
    """A document that cannot be ingested; the message names the file (and line)."""


class DocumentTooLarge(IngestError):
    """A document over `limits.max_document_chars` (HTTP 413)."""


class DocumentExists(IngestError):
    """A different document holds this id and the caller did not ask to replace it (HTTP 409)."""


class IngestCancelled(Exception):
    """The ingest stopped between two chunks because its caller gave up (nothing was committed)."""


class KVCache(Protocol):
    """What ingest needs from app.engine.kv.ChunkKVCache."""

    def passage_ids(self, chunk_ids: Sequence[int], title: str | None = None) -> list[int]: ...
    def key(self, ids: Sequence[int], collection: str = "") -> str: ...
    def ensure(self, ids: Sequence[int], collection: str = "") -> str: ...
    def delete(self, key: str) -> None: ...


@dataclass
class SourceDocument:
    doc_id: str
    title: str | None
    text: str
    source: str  # where it came from, for messages: "path" or "path:line"


@dataclass
class IngestResult:
    doc_id: str
    status: Literal["added", "updated", "unchanged"]
    n_chunks: int
    seconds: float


@dataclass
class PreparedDocument:
    """A chunked document, and whether it differs from the stored version."""

    doc: SourceDocument
    chunks: list[Chunk]
    content_hash: str
    existed: bool
    unchanged: bool


def _noop(n: int) -> None:
    pass


@dataclass
class Ingestor:
    retriever: Retriever
    chunker: Chunker
    kv_cache: KVCache
    max_chars: int | None = None  # per document; longer ones raise DocumentTooLarge before any work
    on_embedded: Callable[[int], object] = _noop  # progress: called with a number of chunks
    on_precomputed: Callable[[int], object] = _noop
    precompute_at: Literal["ingest", "first_use"] = "ingest"
    collection: str = ""  # the tenant whose collection the documents are ("": the shared one)

    def ingest(self, docs: Sequence[SourceDocument], cancelled: Callable[[], bool] = lambda: False, *,
               replace: bool = True) -> list[IngestResult]:
        """Add documents, all or none: chunk all first (bad input fails before anything is written), then
        `commit_all` (the API's uploads). A document whose id holds a different one replaces it only with
        `replace` (else DocumentExists); the same document again is "unchanged" either way. IngestError,
        or IngestCancelled when `cancelled()` turns true."""
        prepared = []
        for doc in docs:
            if cancelled():
                raise IngestCancelled(f"{doc.source}: ingest cancelled")
            prepared.append(self.prepare(doc))
        if not replace and (taken := next((p for p in prepared if p.existed and not p.unchanged), None)):
            raise DocumentExists(f"{taken.doc.source}: a different document has the id {taken.doc.doc_id!r}; "
                                 f"send replace=true to replace it")
        return self.commit_all(prepared, cancelled)

    def ingest_text(self, doc_id: str, title: str | None, text: str, source: str | None = None) -> IngestResult:
        """Add or replace one document given as text: `ingest` of one."""
        return self.ingest([SourceDocument(doc_id, title, text, source or doc_id)])[0]

    def delete(self, doc_id: str) -> None:
        """Remove a document, its index entries and its KV entries; KeyError if unknown."""
        for key in self.retriever.delete_document(doc_id, self.collection):
            self.kv_cache.delete(key)

    def prepare(self, doc: SourceDocument) -> PreparedDocument:
        """Chunk the document and decide whether anything changed (cheap: tokenization only)."""
        title = unicodedata.normalize("NFC", doc.title.strip()) if doc.title else None
        doc = SourceDocument(unicodedata.normalize("NFC", doc.doc_id.strip()), title or None,
                             normalize_text(doc.text), doc.source)
        _check_document(doc)
        if self.max_chars is not None and len(doc.text) > self.max_chars:
            raise DocumentTooLarge(f"{doc.source}: {len(doc.text):,} characters, over the limit of "
                                   f"{self.max_chars:,} (limits.max_document_chars)")
        chunks = self.chunker.chunk(doc.doc_id, doc.text)
        if not chunks:
            raise IngestError(f"{doc.source}: empty document")
        content_hash = sha256_text(doc.text)
        old = self.retriever.get_document(doc.doc_id, self.collection)
        unchanged = old is not None and old.content_hash == content_hash and old.title == doc.title and \
            [(c.text, c.kv_key) for c in self.retriever.document_chunks(doc.doc_id, self.collection)] == \
            [(c.text, self._key(c, doc.title)) for c in chunks]
        return PreparedDocument(doc, chunks, content_hash, old is not None, unchanged)

    def commit(self, prepared: PreparedDocument, cancelled: Callable[[], bool] = lambda: False) -> IngestResult:
        """Embed and precompute, then write metadata + index; the previous version survives any failure."""
        return self.commit_all([prepared], cancelled)[0]

    def commit_all(self, prepared: Sequence[PreparedDocument],
                   cancelled: Callable[[], bool] = lambda: False) -> list[IngestResult]:
        """Commit several documents in one transaction: all of them, or none (IngestCancelled when
        `cancelled()` turns true between two chunks)."""
        start = time.perf_counter()
        changed = [p for p in prepared if not p.unchanged]
        written: list[str] = []
        try:
            # 1. Embed and precompute: nothing is visible to queries yet.
            entries = [self._embed_and_precompute(p, written, cancelled) for p in changed]
            # 2. Commit metadata, then the index (see retrieval.retriever for the crash story).
            stale = self.retriever.add_documents(entries, self.collection) if entries else []
        except BaseException:
            self._forget(written)
            raise
        # 3. KV entries only the replaced versions used.
        for key in stale:
            self.kv_cache.delete(key)
        seconds = time.perf_counter() - start
        results = []
        for p in prepared:
            status = "unchanged" if p.unchanged else "updated" if p.existed else "added"
            results.append(IngestResult(p.doc.doc_id, status, len(p.chunks), 0.0 if p.unchanged else seconds))
            if not p.unchanged:
                log.info("document ingested", extra={"doc_id": p.doc.doc_id, "status": status,
                                                     "chunks": len(p.chunks), "seconds": round(seconds, 3)})
        return results

    def _embed_and_precompute(self, prepared: PreparedDocument, written: list[str],
                              cancelled: Callable[[], bool]) -> tuple[DocumentInfo, list[Chunk], np.ndarray]:
        """The document as the retriever stores it; every chunk's KV key is appended to `written`."""
        doc, chunks = prepared.doc, prepared.chunks
        embeddings = self.retriever.embed_chunks(chunks, doc.title, self.on_embedded)
        for chunk in chunks:
            if cancelled():
                raise IngestCancelled(f"{doc.source}: ingest cancelled")
            if self.precompute_at == "first_use":
                chunk.kv_key = self._key(chunk, doc.title)  # computed by the first query that retrieves it
                continue
            chunk.kv_key = self.kv_cache.ensure(self.kv_cache.passage_ids(chunk.token_ids, doc.title), self.collection)
            written.append(chunk.kv_key)
            self.on_precomputed(1)
        info = DocumentInfo(doc.doc_id, doc.title, doc.source, prepared.content_hash, len(chunks), time.time())
        return info, chunks, embeddings

    def _key(self, chunk: Chunk, title: str | None) -> str:
        return self.kv_cache.key(self.kv_cache.passage_ids(chunk.token_ids, title), self.collection)

    def _forget(self, keys: list[str]) -> None:
        """Delete KV entries written for a failed document, unless a committed chunk uses them."""
        for key in dict.fromkeys(keys):
            if not self.retriever.is_referenced(key):
                try:
                    self.kv_cache.delete(key)
                except Exception:  # the original error matters more; an orphan entry is harmless
                    log.warning("could not delete KV entry", extra={"key": key}, exc_info=True)


def _check_document(doc: SourceDocument) -> None:
    """The rules of app/validation.py, whichever door the document came in by (CLI files, API)."""
    checks = [("document id", valid_doc_id, doc.doc_id), ("title", valid_title, doc.title),
              ("text", valid_unicode, doc.text)]
    for what, check, value in checks:
        try:
            value is None or check(value)
        except ValueError as exc:
            raise IngestError(f"{doc.source}: {what} {value!r:.60}: {exc}") from None


# Reading files ---------------------------------------------------------------------------------

def normalize_text(text: str) -> str:
    """Unix newlines, no NULs; everything else is kept as written."""
    return text.replace("\r\n", "\n").replace("\r", "\n").replace("\x00", "")


def collect_files(paths: list[Path]) -> tuple[list[tuple[Path, str]], list[str]]:
    """(file, doc id) for every input file, in order, and an error line for every bad path."""
    files, errors = [], []
    for path in paths:
        if path.is_dir():
            for file in sorted(path.rglob("*")):
                relative = file.relative_to(path)
                if file.is_file() and file.suffix.lower() in SUFFIXES and \
                        not any(part.startswith(".") for part in relative.parts):
                    files.append((file, relative.with_suffix("").as_posix()))
        elif not path.exists():
            errors.append(f"{path}: no such file or folder")
        elif path.suffix.lower() not in SUFFIXES:
            errors.append(f"{path}: unsupported file type {path.suffix or '(none)'!r}: use .txt, .md or .jsonl")
        else:
            files.append((path, path.stem))
    return files, errors


def read_documents(path: Path, doc_id: str) -> tuple[list[SourceDocument], list[str]]:
    """The documents in one file, and an error line for each bad one (a JSONL file may hold both)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        return [], [f"{path}: cannot read: {exc.strerror or exc}"]
    return parse_documents(data, path.suffix, path.stem, doc_id, str(path))


def parse_documents(data: bytes, suffix: str, stem: str, doc_id: str, source: str
                    ) -> tuple[list[SourceDocument], list[str]]:
    """The documents in a file's bytes, read as its `suffix` says (.txt, .md, .jsonl): `ragblend ingest` reads
    files, the API uploads. `stem` is the default title, `source` names the file in messages."""
    try:
        text = decode_text(data, source)
    except IngestError as exc:
        return [], [str(exc)]
    if suffix.lower() == ".jsonl":
        return _read_jsonl(source, stem, doc_id, text)
    title = stem
    if suffix.lower() == ".md":
        title, text = _markdown_title(text, title)
    return [SourceDocument(doc_id, title, text, source)], []


def decode_text(data: bytes, source: str) -> str:
    if b"\x00" in data:
        raise IngestError(f"{source}: binary file, not text")
    try:
        return normalize_text(data.decode("utf-8-sig"))
    except UnicodeDecodeError as exc:
        raise IngestError(f"{source}: not UTF-8 text (invalid byte at offset {exc.start})") from None


def _markdown_title(text: str, fallback: str) -> tuple[str, str]:
    match = _HEADING.search(text)
    if match is None:
        return fallback, text
    if not text[:match.start()].strip():  # the heading opens the document: it becomes the title
        text = text[match.end():]
    return match.group(1), text


def _read_jsonl(source: str, stem: str, file_id: str, text: str) -> tuple[list[SourceDocument], list[str]]:
    docs, errors = [], []
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{source}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            errors.append(f"{where}: malformed JSON: {exc.msg} (column {exc.colno})")
            continue
        except RecursionError:  # brackets nested deeper than the parser's stack
            errors.append(f"{where}: nested too deeply")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            errors.append(f'{where}: expected an object with a "text" string')
            continue
        doc_id, title = obj.get("id"), obj.get("title")
        if doc_id is not None and (isinstance(doc_id, bool) or not isinstance(doc_id, (str, int))):
            errors.append(f'{where}: "id" must be a string or an integer')
            continue
        if title is not None and not isinstance(title, str):
            errors.append(f'{where}: "title" must be a string')
            continue
        doc = SourceDocument(f"{file_id}:{number}" if doc_id is None else str(doc_id),
                             stem if title is None else title, obj["text"], where)
        try:
            _check_document(doc)
        except IngestError as exc:
            errors.append(str(exc))
            continue
        docs.append(doc)
    return docs, errors
