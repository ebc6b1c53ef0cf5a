"""Helpers for tests and benchmarks: models loaded once per process, a dict KV cache, MuSiQue data."""
from __future__ import annotations

import hashlib
import json
from functools import cache
from pathlib import Path
from typing import Any

from app.config import EmbedderSettings, Settings, load_settings
from retrieval.embedder import Embedder, open_embedder

ROOT = Path(__file__).resolve().parent.parent
MODEL_CACHE = ROOT / "data" / "models"  # the converted LLM, shared so tests never reconvert
MUSIQUE = ROOT.parent / "shared" / "data" / "musique_dev.json"  # read in place, never copied


def test_settings(data_dir: Path, **overrides: Any) -> Settings:
    return load_settings(data_dir=data_dir, model={"cache_dir": str(MODEL_CACHE)}, **overrides)


test_settings.__test__ = False  # not a pytest test


@cache
def shared_tokenizer():
    """The LLM's tokenizer alone (no weights), as load_model would load it."""
    from transformers import AutoTokenizer

    from blend.model import convert_embedded

    return AutoTokenizer.from_pretrained(convert_embedded(MODEL_CACHE))


@cache
def shared_embedder() -> Embedder:
    return open_embedder(EmbedderSettings())


@cache
def shared_llm():
    from blend.model import load_model

    return load_model("embedded", cache_dir=MODEL_CACHE)


class DictKVCache:
    """Stands in for app.kv.ChunkKVCache in unit tests of ingest bookkeeping: key -> passage text."""

    def __init__(self) -> None:
        self.entries: dict[str, str] = {}
        self.fail_on: str | None = None  # ensure() raises for a text containing this

    def key(self, text: str, title: str | None = None) -> str:
        return hashlib.sha256(f"{title}\x00{text}".encode()).hexdigest()

    def ensure(self, text: str, title: str | None = None) -> str:
        if self.fail_on is not None and self.fail_on in text:
            raise RuntimeError(f"precompute failed on {self.fail_on!r}")
        key = self.key(text, title)
        self.entries[key] = text
        return key

    def delete(self, key: str) -> None:
        self.entries.pop(key, None)


def load_musique(limit: int | None = None) -> list[dict]:
    """`{question, answers, ctxs: [{title, text}]}` records of the shared MuSiQue subset."""
    with MUSIQUE.open() as f:
        return json.load(f)[:limit]
