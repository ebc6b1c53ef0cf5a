"""Keys: one key per (model, context, tokens); only 64-hex keys reach a tier."""
from __future__ import annotations

import pytest
import torch

from common.chunk_kv import hash_ids
from store import BytesTier, DiskTier, MemoryTier, kv_key, validate_key
from tests.helpers import random_kv

CTX = hash_ids([1, 2, 3])


def test_key_is_sha256_hex_and_deterministic():
    key = kv_key("model-a", CTX, [5, 6, 7])
    assert validate_key(key) == key and len(key) == 64
    assert kv_key("model-a", CTX, torch.tensor([5, 6, 7])) == key  # list or tensor: same key


@pytest.mark.parametrize("other", [
    ("model-b", CTX, [5, 6, 7]),         # another model
    ("model-a", hash_ids([1, 2]), [5, 6, 7]),  # another prompt head
    ("model-a", CTX, [5, 6, 8]),         # another token
    ("model-a", CTX, [7, 6, 5]),         # same tokens, other order
    ("model-a", CTX, [5, 6, 7, 0]),      # one more token
])
def test_any_difference_changes_the_key(other):
    assert kv_key(*other) != kv_key("model-a", CTX, [5, 6, 7])


def test_fields_cannot_run_into_each_other():
    assert kv_key("ab", "c", [1]) != kv_key("a", "bc", [1])


@pytest.mark.parametrize("bad", ["", "A" * 64, "g" * 64, "a" * 63, "a" * 65, "a" * 64 + "\n",
                                 "../../etc/passwd", "../" + "a" * 61, None, 123])
def test_bad_keys_are_rejected(bad):
    with pytest.raises(ValueError):
        validate_key(bad)


def test_tiers_refuse_bad_keys_before_touching_anything(tmp_path):
    disk = DiskTier(tmp_path / "kv", 1 << 20)
    before = sorted(tmp_path.rglob("*"))  # the tier's index: cache.db and its WAL
    memory = MemoryTier(1 << 20)
    for call in (lambda: memory.put("../escape", random_kv(0)[1]), lambda: memory.get("../escape"),
                 lambda: memory.delete("../escape"), lambda: memory.contains("A" * 64)):
        with pytest.raises(ValueError):
            call()
    for tier in (BytesTier(1 << 20), disk):
        for call in (lambda t: t.put("../escape", b"x"), lambda t: t.get("../escape"),
                     lambda t: t.delete("../escape"), lambda t: t.contains("A" * 64),
                     lambda t: t.reader("../escape"), lambda t: t.head("../escape", 8)):
            with pytest.raises(ValueError):
                call(tier)
    assert sorted(tmp_path.rglob("*")) == before and disk.stats()["entries"] == 0
