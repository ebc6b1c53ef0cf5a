"""Retrieval: chunking, embeddings, the FAISS index and chunk/document metadata.

Exports
    Chunker(tokenizer, ChunkingSettings).chunk(doc_id, text) -> list[Chunk]
    Chunk                 doc_id, ordinal, text, token_ids, start, end, content_hash; id and kv_key once stored
    Embedder, open_embedder(EmbedderSettings) -> Embedder      (all-MiniLM-L6-v2, offline, CPU)
        embed(texts) -> [n, dim] float32 unit norm; window, count_tokens(texts); embedder_name(settings): its id
    Retriever(index_dir, embedder, kind, order, top_k, metadata=None)
        search(question, top_k=None, order=None) -> list[Hit]  (chunk, its document's title, score)
        add_document(doc_id, chunks, ...), delete_document(doc_id), list_documents(), get_document(doc_id)
        each with `tenant=`: the collection ("" shared; retrieval.documents: tenant gives each tenant its own)
    Metadata, open_metadata(database_url, index_dir)        documents + chunks: SQLite or PostgreSQL
        also the change log the index follows and KV usage counts (record_usage, usage)
    DocumentInfo, VectorIndex, IndexMismatchError, SchemaError
    ChunkingSettings, EmbedderSettings, RetrievalSettings      this package's settings

The metadata is the truth (embeddings included): SQLite at <index dir>/metadata.sqlite by default,
or PostgreSQL shared by replicas (`retrieval.database_url`). chunks.faiss in the index dir is
this process's cache of the vectors, caught up from the metadata's change log before a search.
"""
from __future__ import annotations

from retrieval.backends import open_metadata
from retrieval.chunker import Chunk, Chunker
from retrieval.embedder import Embedder, embedder_name, open_embedder
from retrieval.index import VectorIndex
from retrieval.metadata import DocumentInfo, Metadata, SchemaError
from retrieval.retriever import Hit, IndexMismatchError, Retriever
from retrieval.settings import ChunkingSettings, EmbedderSettings, RetrievalSettings

__all__ = ["Chunk", "Chunker", "ChunkingSettings", "DocumentInfo", "Embedder", "EmbedderSettings", "Hit",
           "IndexMismatchError", "Metadata", "RetrievalSettings", "Retriever", "SchemaError", "VectorIndex",
           "embedder_name", "open_embedder", "open_metadata"]
