"""The cachegen codec's tables for the running model: shared from beside the store, or fitted once.

The tables (store.codecs.CacheGenTables: symbol counts per layer, K/V and channel) are fitted on a fixed
sample: the passages of `cachegen_sample.txt` (the demo corpus's seven texts, shipped with the package),
each precomputed after the prompt head as ingest computes passages. A fixed sample makes the fit
deterministic, so replicas of one model on one kind of device agree before they even share; the shelf
(store.tables) makes them agree anyway. Measured on SmolLM2 (BENCHMARKS.md, "Compressed KV"): tables fitted
on this sample code MuSiQue passages in 3.6% more bytes than tables fitted on other MuSiQue passages, and
5.6% fewer than tables fitted on random token ids.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

from blend import Blender, ChunkKV, PromptFormat
from store import CacheGenTables, StoreSettings, register_tables
from store.codecs import Codec, get_codec
from store.tables import TablesShelf, shared_tables

log = logging.getLogger("ragblend.cachegen")
SAMPLE = Path(__file__).with_name("cachegen_sample.txt")  # passages: a title line, the text; "---" between


def sample_chunks(blender: Blender, prompt: PromptFormat) -> list[ChunkKV]:
    """The sample's passages' KV, each computed after the prompt head (on the model's thread: it runs the model)."""
    head_ids = prompt.head_ids
    head = blender.precompute(head_ids)
    passages = [block.strip().split("\n", 1) for block in SAMPLE.read_text().split("\n---\n")]
    return [blender.precompute(prompt.text_passage_ids(text, title), head_ids, context=head)
            for title, text in passages]


def tier_codecs(settings: StoreSettings, kv_dir: Path, blender: Blender, prompt: PromptFormat,
                tiers: Iterable[str] | None = None) -> dict[str, Codec]:
    """The codec of each of `tiers` (default: those the settings build: Redis only with a Redis URL); cachegen's
    coding with this model's tables, from the shelf beside the store (a file under `kv_dir`, and Redis when the
    store has it), fitted on the sample when none are there yet."""
    wanted = set(tiers) if tiers is not None else {t for t in settings.codecs() if t != "redis" or settings.redis_url}
    names = {tier: name for tier, name in settings.codecs().items() if tier in wanted}
    codecs: dict[str, Codec] = {tier: get_codec(name) for tier, name in names.items() if name != "cachegen"}
    if len(codecs) < len(names):
        shelf = TablesShelf(kv_dir / "cachegen-tables", settings.redis_url, settings.redis_password,
                            settings.redis_prefix, timeout_s=max(settings.redis_timeout_s, 5.0))
        plan = settings.cachegen_bins.plan()

        def fit() -> CacheGenTables:
            log.info("fitting the cachegen tables on %s", SAMPLE.name)
            return CacheGenTables.fit(sample_chunks(blender, prompt), plan)

        try:
            cachegen = register_tables(shared_tables(shelf, blender.fingerprint, plan, fit))
        finally:
            shelf.close()
        codecs |= {tier: cachegen for tier, name in names.items() if name == "cachegen"}
    return codecs
