"""FAISS inner-product index over our own int64 chunk ids, saved atomically.

"flat" (exact, IndexFlatIP) or "hnsw" (approximate, IndexHNSWFlat with inner product), both
under an IndexIDMap2 so search returns chunk ids. HNSW cannot remove vectors: `remove` returns
False there and the caller rebuilds from its own copy of the vectors (metadata.py keeps them).
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

import faiss
import numpy as np

from common import atomic_path

IndexKind = Literal["flat", "hnsw"]
HNSW_M = 32  # neighbours per node: recall vs memory
HNSW_EF_SEARCH = 64  # candidates visited per search (at least k)
# One query is searched on one OpenMP thread: as fast on an idle CPU, and on cores busy with the
# LLM, OpenMP's barriers made a 2-thread flat search of 10k vectors take 25 ms instead of 0.5 ms.
SEARCH_THREADS = 1


class VectorIndex:
    def __init__(self, dim: int, kind: IndexKind = "flat", index: faiss.IndexIDMap2 | None = None) -> None:
        self.dim, self.kind = dim, kind
        self.index = index if index is not None else faiss.IndexIDMap2(_base(dim, kind))

    @classmethod
    def build(cls, dim: int, kind: IndexKind, ids: np.ndarray, vectors: np.ndarray) -> VectorIndex:
        index = cls(dim, kind)
        index.add(ids, vectors)
        return index

    def __len__(self) -> int:
        return self.index.ntotal

    def ids(self) -> np.ndarray:
        return faiss.vector_to_array(self.index.id_map).astype(np.int64)

    def add(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        if len(ids):
            self.index.add_with_ids(np.ascontiguousarray(vectors, dtype=np.float32).reshape(-1, self.dim),
                                    np.ascontiguousarray(ids, dtype=np.int64))

    def remove(self, ids: np.ndarray) -> bool:
        """Remove `ids`; False when this kind cannot (HNSW), leaving the index unchanged."""
        if not len(ids):
            return True
        if self.kind != "flat":
            return False
        self.index.remove_ids(np.ascontiguousarray(ids, dtype=np.int64))
        return True

    def search(self, query: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores [k'], ids [k']) of the nearest vectors to one query, best first; k' <= k."""
        k = min(k, len(self))
        if k == 0:
            return np.zeros(0, np.float32), np.zeros(0, np.int64)
        if self.kind == "hnsw":
            faiss.downcast_index(self.index.index).hnsw.efSearch = max(HNSW_EF_SEARCH, k)
        threads = faiss.omp_get_max_threads()
        faiss.omp_set_num_threads(SEARCH_THREADS)
        try:
            scores, ids = self.index.search(np.ascontiguousarray(query, dtype=np.float32).reshape(1, self.dim), k)
        finally:
            faiss.omp_set_num_threads(threads)
        keep = ids[0] >= 0  # HNSW may return fewer than k
        return scores[0][keep], ids[0][keep]

    def save(self, path: Path) -> None:
        """Write to a temp file and rename over `path`: a crash leaves the old file or the new one."""
        with atomic_path(path) as tmp:
            faiss.write_index(self.index, str(tmp))

    @classmethod
    def load(cls, path: Path) -> VectorIndex:
        """Raises FileNotFoundError, or RuntimeError/TypeError for a file that is not an id-mapped index."""
        if not path.exists():
            raise FileNotFoundError(path)
        index = faiss.read_index(str(path))
        if not isinstance(index, faiss.IndexIDMap2):
            raise TypeError(f"{path} is a {type(index).__name__}, not an IndexIDMap2")
        base = faiss.downcast_index(index.index)
        kind: IndexKind = "hnsw" if isinstance(base, faiss.IndexHNSWFlat) else "flat"
        return cls(index.d, kind, index)


def _base(dim: int, kind: IndexKind) -> faiss.Index:
    if kind == "flat":
        return faiss.IndexFlatIP(dim)
    if kind == "hnsw":
        return faiss.IndexHNSWFlat(dim, HNSW_M, faiss.METRIC_INNER_PRODUCT)
    raise ValueError(f"unknown index kind {kind!r}: use flat or hnsw")
