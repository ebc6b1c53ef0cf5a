"""Helpers for tests and benchmarks: paths, models loaded once per process, a dict KV cache,
random chunk KVs, the shared MuSiQue data."""
from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import torch

from app.config import Settings, load_settings
from blend.model import EMBEDDED, served_name
from common.chunk_kv import ChunkKV, hash_ids
from retrieval import EmbedderSettings
from retrieval.embedder import Embedder, open_embedder
from store.keys import kv_key

ROOT = Path(__file__).resolve().parent.parent
MODEL_CACHE = ROOT / "data" / "models"  # the converted LLM, shared so tests never reconvert
MODEL = served_name(EMBEDDED)  # the embedded model's id (GET /v1/models): with retrieval; MODEL + "-chat" without
MUSIQUE = ROOT.parent / "shared" / "data" / "musique_dev.json"  # read in place, never copied


def test_settings(data_dir: Path, **overrides: Any) -> Settings:
    """Settings in `data_dir` that reuse the converted model cache."""
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
    """Stands in for app.engine.kv.ChunkKVCache in unit tests of ingest bookkeeping: key -> passage text."""

    def __init__(self) -> None:
        self.tokenizer = shared_tokenizer()
        self.entries: dict[str, str] = {}
        self.fail_on: str | None = None  # ensure() raises for a passage whose text contains this

    def passage_ids(self, chunk_ids: Sequence[int], title: str | None = None) -> list[int]:
        return self.tokenizer.encode(f"{title}\n", add_special_tokens=False) + list(chunk_ids)

    def key(self, ids: Sequence[int], collection: str = "") -> str:
        return hashlib.sha256((str(list(ids)) + (f"@{collection}" if collection else "")).encode()).hexdigest()

    def ensure(self, ids: Sequence[int], collection: str = "") -> str:
        text = self.tokenizer.decode(ids)
        if self.fail_on is not None and self.fail_on in text:
            raise RuntimeError(f"precompute failed on {self.fail_on!r}")
        key = self.key(ids, collection)
        self.entries[key] = text
        return key

    def delete(self, key: str) -> None:
        self.entries.pop(key, None)


def load_musique(limit: int | None = None) -> list[dict]:
    """`{question, answers, ctxs: [{title, text}]}` records of the shared MuSiQue subset."""
    with MUSIQUE.open() as f:
        return json.load(f)[:limit]


def random_kv(seed: int, shape: tuple[int, int, int, int] = (4, 3, 17, 8), fingerprint: str = "model-a",
              context: list[int] | None = None, dtype: torch.dtype = torch.float32) -> tuple[str, ChunkKV]:
    """(key, kv): a random chunk KV of shape [L, H, T, D] under its own key."""
    g = torch.Generator().manual_seed(seed)
    L, H, T, D = shape
    keys = torch.randn(L, H, T, D, generator=g)  # [L, H, T, D]
    keys[..., 0] *= 20  # an outlier channel, as real keys have
    values = torch.randn(L, H, T, D, generator=g)  # [L, H, T, D]
    token_ids = torch.randint(0, 49152, (T,), generator=g)
    kv = ChunkKV(keys.to(dtype), values.to(dtype), token_ids, position=len(context or []),
                 context_hash=hash_ids(context or []), fingerprint=fingerprint)
    return kv_key(fingerprint, kv.context_hash, token_ids), kv


def assert_same_kv(got: ChunkKV, want: ChunkKV, codec: str = "fp16") -> None:
    """`got` is `want` after a round trip through `codec`, back in want's dtype: native bit-exact, fp16
    bit-exact to want cast to fp16, a quantising codec within its stated per-element bound (plus the
    dtype's rounding)."""
    assert torch.equal(got.token_ids, want.token_ids)
    assert (got.position, got.context_hash, got.fingerprint) == (want.position, want.context_hash, want.fingerprint)
    assert got.keys.dtype == want.keys.dtype and got.values.dtype == want.values.dtype
    if codec in ("native", "fp16"):
        cast = (lambda t: t) if codec == "native" else (lambda t: t.half().to(want.keys.dtype))  # noqa: E731
        assert torch.equal(got.keys.cpu(), cast(want.keys)) and torch.equal(got.values.cpu(), cast(want.values))
        return
    eps = 1e-6 if want.keys.dtype == torch.float32 else torch.finfo(want.keys.dtype).eps
    for x, y, bound in zip((want.keys, want.values), (got.keys, got.values), codec_error_bound(codec, want)):
        x, y = x.float(), y.cpu().float()
        assert ((x - y).abs() <= bound * (1 + 1e-4) + eps * x.abs()).all(), f"{codec}: error past its bound"


def codec_error_bound(codec: str, kv: ChunkKV) -> tuple[torch.Tensor, torch.Tensor]:
    """Each codec's stated bound on |x - decoded| (store/codecs.py), for keys and values, broadcastable to
    [L, H, T, D]: half a quantisation step, from the scales the codec itself stores."""
    from store.codecs import get_codec

    coder = get_codec(codec)
    return coder.error_bound(coder.pack(kv.keys, kv.values), kv.keys.shape[2])


def all_layers(entry) -> ChunkKV:
    """Every layer of an open store entry (a LayerSource), stacked: what a loader reading all of it gets."""
    layers = [entry.layer(i) for i in range(entry.num_layers)]
    return ChunkKV(torch.stack([k for k, _ in layers]), torch.stack([v for _, v in layers]), entry.token_ids,
                   entry.position, entry.context_hash, entry.fingerprint)


def run_in_threads(target: Callable[[int], None], count: int) -> None:
    """Run target(0..count-1) in `count` threads at once; re-raise the first error (a thread's own
    assertion would otherwise be lost)."""
    errors: list[BaseException] = []

    def guarded(index: int) -> None:
        try:
            target(index)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
