"""Retrieval: chunking, embeddings, the FAISS index and chunk/document metadata.

Exports
    Chunker(tokenizer, chunking_settings).chunk(doc_id, text) -> list[Chunk]
    Chunk                 doc_id, ordinal, text, token_ids, start, end, content_hash, n_tokens
    Embedder, open_embedder(embedder_settings) -> Embedder      (all-MiniLM-L6-v2, offline, CPU)
    Retriever, open_retriever(settings, *, embedder=None) -> Retriever
        search(question, top_k=None, order=None) -> list[RetrievedChunk]
        add_document(doc_id, chunks, ...), delete_document(doc_id), list_documents(), get_document(doc_id)
    RetrievedChunk        chunk_id, doc_id, title, ordinal, text, kv_key, score
    DocumentInfo, StoredChunk, VectorIndex, IndexMismatchError

Layout under settings.index_dir: metadata.sqlite (the truth, embeddings included) and
chunks.faiss (a cache of the vectors, rebuilt from SQLite whenever it disagrees).
"""
from __future__ import annotations

from app.config import Settings
from retrieval.chunker import Chunk, Chunker
from retrieval.embedder import Embedder, open_embedder
from retrieval.index import VectorIndex
from retrieval.metadata import DocumentInfo, StoredChunk
from retrieval.retriever import IndexMismatchError, RetrievedChunk, Retriever


def open_retriever(settings: Settings, *, embedder: Embedder | None = None) -> Retriever:
    """The index under settings.index_dir, with the configured embedder (loaded unless given)."""
    r = settings.retrieval
    return Retriever(settings.index_dir, embedder or open_embedder(settings.embedder), kind=r.index,
                     order=r.order, top_k=r.top_k)


__all__ = ["Chunk", "Chunker", "DocumentInfo", "Embedder", "IndexMismatchError", "RetrievedChunk", "Retriever",
           "StoredChunk", "VectorIndex", "open_embedder", "open_retriever"]
