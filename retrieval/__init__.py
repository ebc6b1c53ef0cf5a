"""Retrieval: chunking, embeddings, the FAISS index and chunk/document metadata.

Exports
    Chunker(tokenizer, ChunkingSettings).chunk(doc_id, text) -> list[Chunk]
    Chunk                 doc_id, ordinal, text, token_ids, start, end, content_hash; id and kv_key once stored
    Embedder, open_embedder(EmbedderSettings) -> Embedder      (all-MiniLM-L6-v2, offline, CPU)
    Retriever(index_dir, embedder, kind, order, top_k)
        search(question, top_k=None, order=None) -> list[Hit]  (chunk, its document's title, score)
        add_document(doc_id, chunks, ...), delete_document(doc_id), list_documents(), get_document(doc_id)
    DocumentInfo, VectorIndex, IndexMismatchError
    ChunkingSettings, EmbedderSettings, RetrievalSettings      this package's settings

Layout under the index dir: metadata.sqlite (the truth, embeddings included) and chunks.faiss
(a cache of the vectors, rebuilt from SQLite whenever it disagrees).
"""
from __future__ import annotations

from retrieval.chunker import Chunk, Chunker
from retrieval.embedder import Embedder, open_embedder
from retrieval.index import VectorIndex
from retrieval.metadata import DocumentInfo
from retrieval.retriever import Hit, IndexMismatchError, Retriever
from retrieval.settings import ChunkingSettings, EmbedderSettings, RetrievalSettings

__all__ = ["Chunk", "Chunker", "ChunkingSettings", "DocumentInfo", "Embedder", "EmbedderSettings", "Hit",
           "IndexMismatchError", "RetrievalSettings", "Retriever", "VectorIndex", "open_embedder"]
