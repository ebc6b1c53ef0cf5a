"""Embedder: normalized float32 vectors, batching that changes nothing, and no network at all."""
from __future__ import annotations

import os
import socket

import numpy as np
import pytest

from retrieval import EmbedderSettings, open_embedder
from retrieval.embedder import embedded_model_path


def test_vectors_are_unit_float32_and_batching_is_invisible(embedder, monkeypatch):
    texts = ["The lighthouse is 31 metres tall.", "How tall is the lighthouse?", "Knead the dough for ten minutes.",
             "", "ünïcödé 東京 🙂"]
    seen = []
    vectors = embedder.embed(texts, progress=seen.append)
    assert vectors.shape == (5, 384) and vectors.dtype == np.float32 and sum(seen) == 5
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    monkeypatch.setattr(embedder, "batch_size", 2)
    assert np.allclose(embedder.embed(texts), vectors, atol=1e-5)
    assert vectors[0] @ vectors[1] > vectors[2] @ vectors[1]
    assert embedder.embed([]).shape == (0, 384)


def test_loading_never_touches_the_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    embedder = open_embedder(EmbedderSettings(batch_size=4))
    assert embedder.embed(["offline"]).shape == (1, 384)
    assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["TRANSFORMERS_OFFLINE"] == "1"
    assert embedded_model_path().is_dir()


def test_a_missing_model_folder_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="embedder model folder not found"):
        open_embedder(EmbedderSettings(name=str(tmp_path / "nope")))
