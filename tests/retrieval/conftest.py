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


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request, tmp_path) -> str:
    """A fresh database of each backend: the Metadata contract must hold for both."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'metadata.sqlite'}"
    return request.getfixturevalue("postgres_url")


@pytest.fixture
def open_db(database_url, tmp_path):
    """open() -> a new connection (Metadata) to the test's database; all closed at the end."""
    from retrieval import open_metadata

    opened = []

    def open_():
        opened.append(open_metadata(database_url, tmp_path))
        return opened[-1]
    yield open_
    for metadata in opened:
        metadata.close()
