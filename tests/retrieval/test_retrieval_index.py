"""VectorIndex: our int64 ids through FAISS, flat and HNSW, saved atomically."""
from __future__ import annotations

import numpy as np
import pytest

from retrieval import VectorIndex


def unit_vectors(n: int, dim: int = 16, seed: int = 0) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


@pytest.mark.parametrize("kind", ["flat", "hnsw"])
def test_search_returns_our_ids_and_survives_save_load(tmp_path, kind):
    vectors, ids = unit_vectors(200), np.arange(10_000, 10_200, dtype=np.int64) * 7
    index = VectorIndex.build(16, kind, ids, vectors)
    scores, found = index.search(vectors[42], 5)
    assert found[0] == ids[42] and scores[0] == pytest.approx(1.0, abs=1e-5)
    assert list(scores) == sorted(scores, reverse=True)

    index.save(tmp_path / "i.faiss")
    loaded = VectorIndex.load(tmp_path / "i.faiss")
    assert (loaded.kind, loaded.dim, len(loaded)) == (kind, 16, 200)
    assert sorted(loaded.ids()) == sorted(ids)
    assert list(loaded.search(vectors[42], 5)[1]) == list(found)
    assert [p.name for p in tmp_path.iterdir()] == ["i.faiss"]  # no temp file left behind


def test_flat_removes_hnsw_refuses(tmp_path):
    vectors, ids = unit_vectors(50), np.arange(50, dtype=np.int64)
    flat = VectorIndex.build(16, "flat", ids, vectors)
    assert flat.remove(np.array([7, 8])) and len(flat) == 48
    assert 7 not in flat.search(vectors[7], 48)[1]
    hnsw = VectorIndex.build(16, "hnsw", ids, vectors)
    assert not hnsw.remove(np.array([7])) and len(hnsw) == 50
    assert hnsw.remove(np.array([], dtype=np.int64))  # nothing to remove is fine for any kind


def test_empty_index_and_small_k(tmp_path):
    index = VectorIndex(16)
    scores, ids = index.search(unit_vectors(1)[0], 5)
    assert len(scores) == len(ids) == 0
    index.add(np.array([3]), unit_vectors(1))
    assert list(index.search(unit_vectors(1)[0], 5)[1]) == [3]


def test_load_rejects_missing_and_garbage(tmp_path):
    with pytest.raises(FileNotFoundError):
        VectorIndex.load(tmp_path / "none.faiss")
    (tmp_path / "bad.faiss").write_bytes(b"not an index")
    with pytest.raises(RuntimeError):
        VectorIndex.load(tmp_path / "bad.faiss")
