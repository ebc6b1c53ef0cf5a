"""Wiring: build the model, blender, store, KV cache and retriever from Settings, once."""
from __future__ import annotations

from dataclasses import dataclass

from app.config import Settings
from app.kv import ChunkKVCache
from blend import Blender, LoadedModel, PromptFormat, load_model
from store import TieredStore, build_store


def load_llm(settings: Settings) -> LoadedModel:
    return load_model(settings.model.name, cache_dir=settings.model_cache_dir, dtype=settings.model.dtype)


def open_store(settings: Settings, fingerprint: str) -> TieredStore:
    return build_store(settings.store, settings.kv_dir, fingerprint)


def build_blender(settings: Settings, loaded: LoadedModel) -> Blender:
    """The Blender for the blend settings; a check layer the model cannot have is a config error."""
    try:
        return Blender(loaded.model, loaded.tokenizer, loaded.fingerprint, check_layer=settings.blend.check_layer,
                       deviation=settings.blend.deviation, selection=settings.blend.selection)
    except ValueError as exc:
        raise ValueError(f"invalid blend settings: {exc}") from None


def build_kv_cache(settings: Settings, loaded: LoadedModel, store: TieredStore) -> ChunkKVCache:
    blender = build_blender(settings, loaded)
    prompt = PromptFormat(loaded.tokenizer, settings.model.system_prompt)
    return ChunkKVCache(blender, prompt, store, precompute=settings.blend.precompute)


@dataclass
class Components:
    settings: Settings
    loaded: LoadedModel
    store: TieredStore
    kv_cache: ChunkKVCache
    retriever: object

    @classmethod
    def open(cls, settings: Settings) -> Components:
        from retrieval import open_retriever

        loaded = load_llm(settings)
        store = open_store(settings, loaded.fingerprint)
        kv_cache = build_kv_cache(settings, loaded, store)
        return cls(settings, loaded, store, kv_cache, open_retriever(settings))

    @property
    def blender(self) -> Blender:
        return self.kv_cache.blender

    @property
    def prompt(self) -> PromptFormat:
        return self.kv_cache.prompt

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    def close(self) -> None:
        self.store.close()
        close = getattr(self.retriever, "close", None)
        if close:
            close()
