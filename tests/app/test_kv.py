"""ChunkKVCache on the real model and a real store: a chunk's KV is the same computed or loaded."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.components import Components
from app.config import load_settings
from blend import SamplingParams

pytestmark = pytest.mark.slow
MODEL_CACHE = Path(__file__).resolve().parents[2] / "data" / "models"


@pytest.mark.parametrize("codec", ["fp16", "int8"])
def test_same_question_twice_miss_then_hit_gives_identical_logits_and_answer(tmp_path, smollm, musique, codec):
    settings = load_settings(data_dir=tmp_path / "data", model={"cache_dir": str(MODEL_CACHE)},
                             store={"codec": codec})
    item = musique[0]
    def components() -> Components:
        parts = Components(settings)
        parts.llm = smollm
        return parts

    def ask(kv_cache) -> tuple[list[str], torch.Tensor, list[int]]:
        passages = [kv_cache.prompt.text_passage_ids(c["text"][:500], c["title"] or None) for c in item["ctxs"][:3]]
        computed = [not kv_cache.store.contains(kv_cache.key(ids)) for ids in passages]
        keys = [kv_cache.ensure(ids) for ids in passages]  # ingest's path: computed and stored where missing
        loaded = [kv_cache.lookup_key(key, ids) for key, ids in zip(keys, passages)]  # the planner's read
        loaded = [(kv, "computed" if fresh else tier) for fresh, (kv, tier) in zip(computed, loaded)]
        segments = [kv_cache.head()] + [kv for kv, _ in loaded]
        prefill = kv_cache.blender.prefill(segments, kv_cache.prompt.suffix_ids(item["question"]), 0.15)
        logits = prefill.logits.clone()
        return [tier for _, tier in loaded], logits, list(decoder.generate(prefill, SamplingParams(8)))

    parts = components()
    decoder = parts.runtime
    first_tiers, first_logits, first_answer = ask(parts.kv_cache)   # every chunk computed (a miss)
    tiers, logits, answer = ask(parts.kv_cache)                       # every chunk from memory (a hit)
    assert first_tiers == ["computed"] * 3 and tiers == ["memory"] * 3
    assert torch.equal(logits, first_logits) and answer == first_answer
    parts.close()

    # A new process: the head and every chunk come from disk, still the same numbers.
    parts = components()
    tiers, logits, answer = ask(parts.kv_cache)
    assert tiers == ["disk"] * 3
    assert torch.equal(logits, first_logits) and answer == first_answer
    parts.close()
