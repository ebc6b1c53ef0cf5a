"""The retrieval index as one object: metadata (the truth, SQLite or PostgreSQL) + a FAISS index
(this process's cache of the chunk vectors).

The index follows the metadata's change log (retrieval/metadata.py): before each search one cheap
query reads the high-water marks (highest chunk id, highest deletion seq); when they moved, only
the chunks added and deleted since are applied. Whoever committed them: this process,
`ragblend ingest`, another replica on the same PostgreSQL. Writes commit to the metadata first,
then catch the index up the same way and save it (temp file + rename). Opening lines a saved
index up with the table by id difference, so a stale or torn file costs only what changed.
One instance may be shared by threads: an internal lock serializes index and metadata access.

Collections: every document belongs to a tenant's collection ("" is the shared one; retrieval.metadata). One
FAISS index holds them all, and a search keeps the nearest chunks of the asker's collection: FAISS is asked
for k, then 4k, 16k, ... nearest until k of them are the collection's or the whole index was searched. The
metadata, the truth, filters in the query that already reads the hits' rows, so no per-collection id lists
have to follow the change log; a search where every chunk is the asker's (the shared default) costs as before.
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
from retrieval.metadata import DB_FILE, DocumentInfo, Marks, Metadata
from retrieval.sqlite import SQLiteMetadata

log = logging.getLogger("ragblend.retrieval")

Order = Literal["score", "document"]
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
    """Search and update one collection. `metadata` defaults to SQLite under `index_dir` (then owned
    and closed here); the FAISS file always lives in `index_dir`, one per process or replica."""

    def __init__(self, index_dir: Path, embedder: Embedder, kind: IndexKind = "flat", order: Order = "score",
                 top_k: int = 4, metadata: Metadata | None = None) -> None:
        self.embedder, self.kind, self.order, self.top_k = embedder, kind, order, top_k
        self.index_path = Path(index_dir) / INDEX_FILE
        self._owns_metadata = metadata is None
        self.metadata = metadata if metadata is not None else SQLiteMetadata(Path(index_dir) / DB_FILE)
        self._lock = threading.RLock()
        self._check_embedder()
        self.index, self._marks = self._open_index()

    def close(self) -> None:
        if self._owns_metadata:
            self.metadata.close()

    def __len__(self) -> int:
        return len(self.index)

    # Queries ---------------------------------------------------------------------------------
    def search(self, question: str, top_k: int | None = None, order: Order | None = None,
               tenant: str = "") -> list[Hit]:
        """The top_k chunks of `tenant`'s collection nearest to `question`, by score or in document order
        (see `_document_order`)."""
        vector = self.embedder.embed_query(question)
        with self._lock:
            self.refresh()
            hits = self._nearest(vector, top_k or self.top_k, tenant)
        return _document_order(hits) if (order or self.order) == "document" else hits

    def _nearest(self, vector: np.ndarray, k: int, tenant: str) -> list[Hit]:
        wanted = k
        while True:
            scores, ids = self.index.search(vector, wanted)
            rows = self.metadata.chunks_with_titles(ids.tolist(), tenant)
            # Another collection's chunk, or one another replica deleted since the refresh, has no row: left out.
            hits = [Hit(*rows[chunk_id], score) for score, chunk_id in zip(scores.tolist(), ids.tolist())
                    if chunk_id in rows]
            if len(hits) >= k or wanted >= len(self.index):
                return hits[:k]
            wanted *= 4

    def list_documents(self, tenant: str = "") -> list[DocumentInfo]:
        return self.metadata.list_documents(tenant)

    def get_document(self, doc_id: str, tenant: str = "") -> DocumentInfo | None:
        return self.metadata.get_document(doc_id, tenant)

    def document_chunks(self, doc_id: str, tenant: str = "") -> list[Chunk]:
        return self.metadata.document_chunks(doc_id, tenant)

    def is_referenced(self, kv_key: str) -> bool:
        return self.metadata.is_referenced(kv_key)

    # Updates ---------------------------------------------------------------------------------
    def embed_chunks(self, chunks: Sequence[Chunk], title: str | None,
                     progress: Callable[[int], object] | None = None) -> np.ndarray:
        return self.embedder.embed([embedding_text(c.text, title) for c in chunks], progress)

    def add_document(self, doc_id: str, chunks: Sequence[Chunk], *, title: str | None = None,
                     source: str | None = None, content_hash: str | None = None,
                     embeddings: np.ndarray | None = None, ingested_at: float | None = None,
                     tenant: str = "") -> list[str]:
        """Add `doc_id` to `tenant`'s collection, replacing any previous version; returns the kv keys no chunk
        uses any more.

        Embeds the chunks unless `embeddings` are given; `content_hash` defaults to one of the chunk texts;
        each chunk's `kv_key` is stored with it.
        """
        if embeddings is None:
            embeddings = self.embed_chunks(chunks, title)
        doc = DocumentInfo(doc_id, title, source, content_hash or sha256_text("\n\n".join(c.text for c in chunks)),
                           len(chunks), ingested_at or time.time())
        return self.add_documents([(doc, chunks, embeddings)], tenant)

    def add_documents(self, docs: Sequence[tuple[DocumentInfo, Sequence[Chunk], np.ndarray]],
                      tenant: str = "") -> list[str]:
        """Add or replace several (document, chunks, embeddings) of `tenant`'s collection at once: all of them,
        or none.

        Returns the kv keys no chunk uses any more.
        """
        ids = [doc.id for doc, _, _ in docs]
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate document ids in one commit: {sorted(i for i in ids if ids.count(i) > 1)}")
        with self._lock:
            stale_keys = self.metadata.replace_documents(docs, tenant)
            self._follow_write()
        return stale_keys

    def delete_document(self, doc_id: str, tenant: str = "") -> list[str]:
        """Remove `doc_id` of `tenant`'s collection (KeyError if it has none); returns the kv keys no chunk uses
        any more."""
        with self._lock:
            stale_keys = self.metadata.delete_document(doc_id, tenant)
            self._follow_write()
        return stale_keys

    def _follow_write(self) -> None:
        """After our own commit: catch the index up (from the log, like anyone's commit) and save it.
        If either fails the commit still stands: the next refresh, or the next open, catches up."""
        self.refresh()
        self.index.save(self.index_path)

    # Consistency -----------------------------------------------------------------------------
    def refresh(self) -> bool:
        """Apply what was committed since we last looked; False (after one cheap query) if nothing was."""
        with self._lock:
            if self.metadata.marks() == self._marks:
                return False
            changes = self.metadata.changes_since(self._marks, self.embedder.dim)
            if not self.index.remove(changes.deleted):  # HNSW cannot delete: rebuild from the table
                self.index, self._marks, _ = self._synced(VectorIndex(self.embedder.dim, self.kind))
                return True
            self.index.add(changes.ids, changes.vectors)
            self._marks = changes.marks
            log.debug("index caught up", extra={"added": len(changes.ids), "deleted": len(changes.deleted)})
            return True

    def _open_index(self) -> tuple[VectorIndex, Marks]:
        """The saved index lined up with the table (saved again if that changed it), or a new one."""
        index, marks, changed = self._synced(self._load_saved())
        if changed or not self.index_path.exists():
            index.save(self.index_path)
        return index, marks

    def _load_saved(self) -> VectorIndex:
        empty = VectorIndex(self.embedder.dim, self.kind)
        try:
            index = VectorIndex.load(self.index_path)
        except FileNotFoundError:
            return empty
        except (RuntimeError, TypeError) as exc:  # a torn or foreign file
            log.warning("index unreadable, rebuilding", extra={"path": str(self.index_path), "error": str(exc)})
            return empty
        if (index.kind, index.dim) != (self.kind, self.embedder.dim):
            log.warning("index of another kind, rebuilding", extra={"path": str(self.index_path)})
            return empty
        return index

    def _synced(self, index: VectorIndex) -> tuple[VectorIndex, Marks, bool]:
        """`index` holding exactly the table's chunk ids (only the difference is removed and fetched),
        the marks it is at, and whether it changed."""
        marks, ids = self.metadata.snapshot_ids()  # sorted
        have = index.ids()
        if len(np.unique(have)) != len(have):  # not something we wrote: start over
            index, have = VectorIndex(self.embedder.dim, self.kind), have[:0]
        extra, missing = np.setdiff1d(have, ids), np.setdiff1d(ids, have)
        if not index.remove(extra):
            index, missing = VectorIndex(self.embedder.dim, self.kind), ids
        index.add(*self.metadata.vectors(missing, self.embedder.dim))
        changed = bool(len(extra) or len(missing))
        if changed:
            log.info("index lined up with the metadata", extra={"path": str(self.index_path),
                                                               "removed": len(extra), "added": len(missing)})
        return index, marks, changed

    def _check_embedder(self) -> None:
        identity = f"{self.embedder.name} dim={self.embedder.dim}"
        stored = self.metadata.get_meta("embedder")
        if stored is not None and stored != identity and self.metadata.count_chunks():
            raise IndexMismatchError(f"the index in {self.metadata.where()} was built with embedder {stored!r}, "
                                     f"not {identity!r}: configure that embedder or delete it and re-ingest")
        if stored != identity:
            self.metadata.set_meta("embedder", identity)


def _document_order(hits: list[Hit]) -> list[Hit]:
    """Chunks of one document together in reading order; documents by their best chunk's score."""
    best: dict[str, int] = {}
    for rank, hit in enumerate(hits):
        best.setdefault(hit.chunk.doc_id, rank)
    return sorted(hits, key=lambda h: (best[h.chunk.doc_id], h.chunk.ordinal))
