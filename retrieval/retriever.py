"""The retrieval index as one object: SQLite metadata (truth) + FAISS vectors (a rebuildable cache).

Write order: the metadata transaction commits first, then the FAISS file is rewritten (temp file
+ rename). A crash in between leaves an index whose ids differ from the metadata; opening
notices and rebuilds the index from the embeddings stored in SQLite. Another process's commits
(`ragblend ingest` while the server runs) are noticed the same way before each search.
One instance may be shared by threads: an internal lock serializes index and metadata access.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from retrieval.chunker import Chunk, sha256_text
from retrieval.embedder import Embedder
from retrieval.index import IndexKind, VectorIndex
from retrieval.metadata import DocumentInfo, Metadata

log = logging.getLogger("ragblend.retrieval")

Order = Literal["score", "document"]
DB_FILE = "metadata.sqlite"
INDEX_FILE = "chunks.faiss"


class IndexMismatchError(RuntimeError):
    """The stored index was built with another embedder."""


@dataclass
class Hit:
    """A search result: a stored chunk, its document's title and its similarity to the question."""

    chunk: Chunk
    title: str | None
    score: float  # cosine similarity to the question


def embedding_text(text: str, title: str | None) -> str:
    """What the embedder reads for a chunk: the document title gives a chunk its topic."""
    return f"{title}\n{text}" if title else text


class Retriever:
    def __init__(self, index_dir: Path, embedder: Embedder, kind: IndexKind = "flat", order: Order = "score",
                 top_k: int = 4) -> None:
        self.embedder, self.kind, self.order, self.top_k = embedder, kind, order, top_k
        self.index_path = Path(index_dir) / INDEX_FILE
        self.metadata = Metadata(Path(index_dir) / DB_FILE)
        self._lock = threading.RLock()
        self._check_embedder()
        self.index = self._load_index()
        self._version = self.metadata.data_version()

    def close(self) -> None:
        self.metadata.close()

    def __len__(self) -> int:
        return len(self.index)

    # Queries ---------------------------------------------------------------------------------
    def search(self, question: str, top_k: int | None = None, order: Order | None = None) -> list[Hit]:
        """The top_k chunks nearest to `question`, by score or in document order (see `_document_order`)."""
        vector = self.embedder.embed_query(question)
        with self._lock:
            self.refresh()
            scores, ids = self.index.search(vector, top_k or self.top_k)
            rows = self.metadata.chunks_with_titles(ids.tolist())
        hits = [Hit(*rows[chunk_id], score) for score, chunk_id in zip(scores.tolist(), ids.tolist())]
        return _document_order(hits) if (order or self.order) == "document" else hits

    def list_documents(self) -> list[DocumentInfo]:
        with self._lock:
            return self.metadata.list_documents()

    def get_document(self, doc_id: str) -> DocumentInfo | None:
        with self._lock:
            return self.metadata.get_document(doc_id)

    def document_chunks(self, doc_id: str) -> list[Chunk]:
        with self._lock:
            return self.metadata.document_chunks(doc_id)

    def is_referenced(self, kv_key: str) -> bool:
        with self._lock:
            return self.metadata.is_referenced(kv_key)

    # Updates ---------------------------------------------------------------------------------
    def embed_chunks(self, chunks: Sequence[Chunk], title: str | None,
                     progress: Callable[[int], object] | None = None) -> np.ndarray:
        return self.embedder.embed([embedding_text(c.text, title) for c in chunks], progress)

    def add_document(self, doc_id: str, chunks: Sequence[Chunk], *, title: str | None = None,
                     source: str | None = None, content_hash: str | None = None,
                     embeddings: np.ndarray | None = None, ingested_at: float | None = None) -> list[str]:
        """Add `doc_id`, replacing any previous version; returns the kv keys no chunk uses any more.

        Embeds the chunks unless `embeddings` are given; `content_hash` defaults to one of the chunk texts;
        each chunk's `kv_key` is stored with it.
        """
        if embeddings is None:
            embeddings = self.embed_chunks(chunks, title)
        doc = DocumentInfo(doc_id, title, source, content_hash or sha256_text("\n\n".join(c.text for c in chunks)),
                           len(chunks), ingested_at or time.time())
        return self.add_documents([(doc, chunks, embeddings)])

    def add_documents(self, docs: Sequence[tuple[DocumentInfo, Sequence[Chunk], np.ndarray]]) -> list[str]:
        """Add or replace several (document, chunks, embeddings) at once: all of them, or none.

        Returns the kv keys no chunk uses any more.
        """
        ids = [doc.id for doc, _, _ in docs]
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate document ids in one commit: {sorted(i for i in ids if ids.count(i) > 1)}")
        with self._lock:
            self.refresh()
            new_ids, old_ids, stale_keys = self.metadata.replace_documents(docs)
            vectors = np.concatenate([e for _, _, e in docs]) if docs else np.zeros((0, self.embedder.dim))
            self._update_index(np.array(old_ids, np.int64), np.array(new_ids, np.int64), vectors)
        return stale_keys

    def delete_document(self, doc_id: str) -> list[str]:
        """Remove `doc_id` (KeyError if unknown); returns the kv keys no chunk uses any more."""
        with self._lock:
            self.refresh()
            old_ids, stale_keys = self.metadata.delete_document(doc_id)
            self._update_index(np.array(old_ids, np.int64), np.zeros(0, np.int64), np.zeros((0, self.embedder.dim)))
        return stale_keys

    def _update_index(self, removed: np.ndarray, added: np.ndarray, vectors: np.ndarray) -> None:
        try:
            if self.index.remove(removed):
                self.index.add(added, vectors)
            else:  # HNSW cannot delete: rebuild from the (already committed) metadata
                self.index = self._rebuild()
            self.index.save(self.index_path)
        except BaseException:
            self.index = self._load_index()  # metadata is committed: bring the index back in line
            raise

    # Consistency -----------------------------------------------------------------------------
    def refresh(self) -> None:
        """Reload the index if another process committed since we last looked (a cheap check)."""
        with self._lock:
            version = self.metadata.data_version()
            if version != self._version:
                self.index, self._version = self._load_index(), version

    def _load_index(self) -> VectorIndex:
        """The saved index if it holds exactly the metadata's chunk ids, else a rebuilt one."""
        try:
            index = VectorIndex.load(self.index_path)
            if (index.kind, index.dim) == (self.kind, self.embedder.dim) and \
                    np.array_equal(np.sort(index.ids()), self.metadata.chunk_ids()):
                return index
            log.warning("index out of date, rebuilding", extra={"path": str(self.index_path)})
        except FileNotFoundError:
            pass
        except (RuntimeError, TypeError) as exc:  # a torn or foreign file
            log.warning("index unreadable, rebuilding", extra={"path": str(self.index_path), "error": str(exc)})
        index = self._rebuild()
        index.save(self.index_path)
        return index

    def _rebuild(self) -> VectorIndex:
        ids, vectors = self.metadata.embeddings(self.embedder.dim)
        return VectorIndex.build(self.embedder.dim, self.kind, ids, vectors)

    def _check_embedder(self) -> None:
        identity = f"{self.embedder.name} dim={self.embedder.dim}"
        stored = self.metadata.get_meta("embedder")
        if stored is not None and stored != identity and len(self.metadata.chunk_ids()):
            raise IndexMismatchError(f"the index in {self.index_path.parent} was built with embedder {stored!r}, "
                                     f"not {identity!r}: configure that embedder or delete the folder and re-ingest")
        if stored != identity:
            self.metadata.set_meta("embedder", identity)


def _document_order(hits: list[Hit]) -> list[Hit]:
    """Chunks of one document together in reading order; documents by their best chunk's score."""
    best: dict[str, int] = {}
    for rank, hit in enumerate(hits):
        best.setdefault(hit.chunk.doc_id, rank)
    return sorted(hits, key=lambda h: (best[h.chunk.doc_id], h.chunk.ordinal))
