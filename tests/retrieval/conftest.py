"""Retrieval fixtures: the real SmolLM2 tokenizer and MiniLM embedder, loaded once per session."""
from __future__ import annotations

import pytest

from tests.helpers import shared_embedder, shared_tokenizer, test_settings


@pytest.fixture(scope="session")
def tokenizer():
    return shared_tokenizer()


@pytest.fixture(scope="session")
def embedder():
    return shared_embedder()


@pytest.fixture
def settings(tmp_path):
    return test_settings(tmp_path)
