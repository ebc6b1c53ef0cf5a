"""Typed settings: configs/default.yaml < a --config file < RAGBLEND_* environment variables."""
from __future__ import annotations

import difflib
import math
import os
import re
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from common.settings import Strict
from retrieval.settings import ChunkingSettings, EmbedderSettings, RetrievalSettings
from store.settings import StoreSettings

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"
ENV_PREFIX = "RAGBLEND_"
ENV_NESTED_DELIMITER = "__"


class ModelSettings(Strict):
    name: str = "embedded"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # auto (CUDA if present) | cpu | cuda | cuda:N

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if value not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", value):
            raise ValueError(f"model.device must be auto, cpu, cuda or cuda:N, got {value!r}")
        return value
    cache_dir: Path | None = None
    system_prompt: str = "Answer the question with a short phrase, using only the passages."
    kv_pool_tokens: int = Field(8192, ge=16)  # decode KV pool: positions per slot (prompt + answer); slots = max_batch
    cuda_graphs: Literal["auto", "on", "off"] = "auto"  # the decode step as CUDA graphs (auto: on CUDA)
    cpu_kernel: Literal["auto", "off"] = "auto"  # CPU kernels (blend.cpu_kernels: torch ops built at first use)
    weights: Literal["float32", "int8", "int4"] = "int4"  # CPU float32 linears (blend.quantized); CUDA: as loaded


class BlendSettings(Strict):
    # A share of cached tokens to recompute, or "auto": the loading controller (blend.controller) picks
    # r >= ratio_floor per request so that loading each layer's KV hides behind the layer's compute.
    ratio: Annotated[float, Field(ge=0.0, le=1.0)] | Literal["auto"] = 0.15
    ratio_floor: float = Field(0.15, ge=0.0, le=1.0)  # the quality floor under ratio: auto
    check_layer: int = Field(1, ge=0)  # at most the model's layers - 2: checked when the Blender is built
    deviation: Literal["value", "key"] = "value"
    precompute: Literal["head", "zero"] = "head"
    # When a chunk's KV is computed: at ingest (every chunk, before it is searchable), or the first
    # time a query retrieves it (ingest only chunks and embeds; the store keeps what is used).
    precompute_at: Literal["ingest", "first_use"] = "ingest"
    selection: str = "query"  # chosen by measurement: BENCHMARKS.md
    # Read retrieved chunks' KV from the store a layer at a time on a loader thread, while the
    # earlier layers compute (blend.pipeline); false loads every chunk whole before the prefill.
    pipeline: bool = True

    @field_validator("selection")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        from blend.selection import get_policy

        return get_policy(value).name  # ValueError naming the known policies



class ServerSettings(Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: str | None = None  # one key, the default tenant's
    # API key -> tenant name (JSON in RAGBLEND_SERVER__API_KEYS): each tenant's leases, cache views and metrics
    # are its own; its documents too with retrieval.documents: tenant
    api_keys: dict[Annotated[str, Field(min_length=1)], Annotated[str, Field(min_length=1, max_length=64)]] = {}
    # each tenant's leases (the default tenant's included) have this share of each tier's pinned cap reserved (scaled
    # down evenly where the tenants' shares add up to more than 1); what no tenant reserved is shared first-come
    tenant_pinned_share: float = Field(0.5, gt=0, le=1)
    # more keys that may read /metrics and /v1/cache's global counters (api_key may too): each names its tenant in
    # api_keys, else it is a key of the default tenant; with keys configured, no other key reads them (a 403)
    admin_keys: list[Annotated[str, Field(min_length=1)]] = []
    queue_size: int = Field(16, ge=1)
    request_timeout_s: float = Field(120.0, gt=0)
    max_batch: int = Field(8, ge=1)  # requests decoded together (slots on the model thread)
    # tokens a model-thread step runs (vLLM's max_num_batched_tokens): a decode row is one, a prefill slice the
    # tokens it runs through one layer over the model's layers; at least one slice a step. 64 measured on the 2-core
    # CPU (bench/fairness.py, BENCHMARKS.md): a short query waits at most one step behind a long prefill, 2.4x its
    # TTFT alone (2048, vLLM's GPU figure: 75x, the step ~10 s here), the long prefill no slower
    step_token_budget: int = Field(64, ge=1)
    # a prefill's least piece of work: one layer over at most this many of its tokens (chunked prefill); null: a
    # whole layer
    prefill_chunk_tokens: int | None = Field(512, ge=1)
    degraded_wait_s: float = Field(30.0, gt=0)  # /health says degraded while a request waits this long for a token
    stuck_after_s: float = Field(120.0, gt=0)  # /health is 503 once the model thread is on one piece this long
    shutdown_grace_s: float = Field(5.0, ge=0)  # running queries may finish within this at shutdown
    warm_up: bool = True  # run a few tiny requests through the model thread before /health says ready

    def tenant_keys(self) -> dict[str, str]:
        """API key -> tenant: `api_keys`, and `api_key` and any other admin key as the default tenant ("")."""
        return dict.fromkeys(self.admin_keys, "") | ({self.api_key: ""} if self.api_key else {}) | self.api_keys

    def tenant_shares(self) -> dict[str, float]:
        """Tenant -> the share of each pinned cap reserved to it: every tenant a key names (the default tenant
        alone where no key is configured)."""
        return dict.fromkeys(set(self.tenant_keys().values()) or {""}, self.tenant_pinned_share)

    def admins(self) -> set[str]:
        """The keys that may read every tenant's counts: admin_keys, and the single api_key."""
        return set(self.admin_keys) | ({self.api_key} if self.api_key else set())


class LimitsSettings(Strict):
    max_question_chars: int = Field(2000, ge=1)
    max_top_k: int = Field(16, ge=1)
    max_new_tokens: int = Field(512, ge=1)
    default_max_new_tokens: int = Field(128, ge=1)
    max_body_bytes: int = Field(10 << 20, ge=1)
    max_document_chars: int = Field(1_000_000, ge=1)
    max_explain_tokens: int = Field(4096, ge=1)  # prompt tokens an `explain: true` response lists
    max_prompt_tokens: int = Field(7680, ge=1)  # a request's prompt: messages, passages and question (else 4xx)
    max_message_tokens: int = Field(7680, ge=1)  # one message of a chat, or a query's question (else 422): up to
    # the prompt budget, so a message carrying pasted documents fits
    max_messages: int = Field(512, ge=1)  # messages of one chat request (else 422)
    grammar_compile_s: float = Field(2.0, gt=0)  # a schema's grammar compiles within this, or is a 400 (too complex)
    grammar_compile_workers: int = Field(2, ge=1)  # child processes that compile grammars (each killed past the limit)
    piece_cost_tokens: int = Field(8, ge=0)  # each message priced as this many tokens more within max_prompt_tokens
    read_token_cost: float = Field(0.0625, ge=0, le=1)  # a prompt token whose KV is read from the store, priced as
    # this share of a computed one (its KV moved and RoPE-shifted, no layer run): checked once the store is looked up
    # /v1/embeddings, priced as prompts are (its word pieces, each text a piece): one request at most this, and a
    # tenant's requests running or waiting at most max_tenant_embedding_tokens together (more: 429)
    max_embedding_tokens: int = Field(65536, ge=1)
    max_tenant_embedding_tokens: int = Field(131072, ge=1)

    def price(self, *, computed: int, read: int, pieces: int) -> int:
        """A prompt's work in computed tokens: those computed, those whose KV is read from the store at
        read_token_cost each, and piece_cost_tokens per piece (a message, a retrieved passage); a request priced
        over max_prompt_tokens is refused before any work."""
        return computed + math.ceil(self.read_token_cost * read) + self.piece_cost_tokens * pieces


class PlannerSettings(Strict):
    """How app.engine.planner cuts a prompt into spans (each a store entry): by content, or LMCache's fixed windows."""
    chunking: Literal["content", "windows"] = "content"
    window_tokens: int = Field(256, ge=8)  # chunking windows: the window, matched at any offset of a later prompt
    average_span_tokens: int = Field(16, ge=4)  # chunking content: the smallest hash of each run of this many
    # positions is a cut candidate (winnowing), so is every line break; a blank line always cuts
    min_span_tokens: int = Field(8, ge=1)  # shorter spans (tiny messages) merge with their neighbours
    max_span_tokens: int = Field(64, ge=2)
    max_spans: int = Field(384, ge=2)  # spans per request at most (each one or two store entries): past it the
    # prompt is cut coarser (every size doubled) until it has no more
    # by_cost: blend the spans found, or compute the prompt whole, whichever the measured rates price cheaper
    # (blend.controller.blend_or_whole; a request's stats.plan says which); off: blend whatever is found
    by_cost: bool = True


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter=ENV_NESTED_DELIMITER, extra="forbid"
    )

    data_dir: Path = Path("data")
    model: ModelSettings = ModelSettings()
    embedder: EmbedderSettings = EmbedderSettings()
    chunking: ChunkingSettings = ChunkingSettings()
    retrieval: RetrievalSettings = RetrievalSettings()
    blend: BlendSettings = BlendSettings()
    store: StoreSettings = StoreSettings()
    server: ServerSettings = ServerSettings()
    limits: LimitsSettings = LimitsSettings()
    planner: PlannerSettings = PlannerSettings()

    @classmethod
    def settings_customise_sources(
        cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Environment beats the YAML files, which arrive as init kwargs.
        return env_settings, init_settings

    # Derived locations under the one data directory.
    @property
    def model_cache_dir(self) -> Path:
        return self.model.cache_dir or self.data_dir / "models"

    @property
    def index_dir(self) -> Path:
        return self.data_dir / "index"

    @property
    def kv_dir(self) -> Path:
        return self.data_dir / "kv"


def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ValueError(f"config file not found: {path}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"config file {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping at the top level")
    return data


def load_settings(config_file: str | Path | None = None, **overrides: Any) -> Settings:
    """Defaults from configs/default.yaml, then `config_file`, then RAGBLEND_* env vars.

    `overrides` (nested dicts) sit between the config file and the environment; tests use them.
    """
    values = _read_yaml(DEFAULT_CONFIG)
    if config_file is not None:
        values = _deep_merge(values, _read_yaml(Path(config_file)))
    values = _deep_merge(values, overrides)
    _check_environment()
    try:
        return Settings(**values)
    except ValidationError as exc:
        unknown = [_unknown(err["loc"]) for err in exc.errors() if err["type"] == "extra_forbidden"]
        if not unknown:
            raise
        raise SettingsError("; ".join(unknown)) from None


class SettingsError(ValueError):
    """A setting no model declares (YAML, overrides or RAGBLEND_* variables): its dotted name and the nearest one."""


def _unknown(loc: tuple[int | str, ...]) -> str:
    """"blend.ratoi: unknown setting; did you mean blend.ratio?" for the extra key at `loc` (pydantic's path, which
    names a union's member by its class: store.codec.TierCodecs.gpux)."""
    model: type[BaseModel] = Settings
    path: list[str] = []
    for part in loc[:-1]:
        if part == model.__name__ or not isinstance(part, str) or part not in model.model_fields:
            continue  # a union member's tag, or a list index
        path.append(part)
        models = _models_in(model.model_fields[part].annotation)
        tagged = [m for m in models if m.__name__ in loc]
        model = (tagged or models or [model])[0]
    return _unknown_message(path, str(loc[-1]), list(model.model_fields))


def _unknown_message(path: list[str], key: str, valid: list[str], variable: str | None = None) -> str:
    dotted = ".".join([*path, key])
    hint = difflib.get_close_matches(key, valid, n=1)
    variable = variable or (name if (name := _env_name([*path, key])) in _environment() else None)
    where = f" (from {variable})" if variable else ""
    if hint:
        return f"{dotted}: unknown setting{where}; did you mean {'.'.join([*path, hint[0]])}?"
    return f"{dotted}: unknown setting{where}; valid here: {', '.join(sorted(valid))}"


def _env_name(path: list[str]) -> str:
    return (ENV_PREFIX + ENV_NESTED_DELIMITER.join(path)).upper()


def _environment() -> dict[str, str]:
    return {name.upper(): value for name, value in os.environ.items() if name.upper().startswith(ENV_PREFIX)}


def _check_environment() -> None:
    """Refuse RAGBLEND_* variables pydantic-settings would skip without a word: a nested one (SECTION__KEY) whose
    section is no setting, and a flat one close to a top-level setting's name (other flat RAGBLEND_* variables
    belong to other tools: RAGBLEND_LOG_LEVEL, RAGBLEND_KERNEL_DIR)."""
    fields = list(Settings.model_fields)
    unknown = []
    for name in _environment():
        path = name[len(ENV_PREFIX):].lower().split(ENV_NESTED_DELIMITER)
        if path[0] in fields:
            continue
        if len(path) > 1 or difflib.get_close_matches(path[0], fields, n=1, cutoff=0.8):
            unknown.append(_unknown_message([], path[0], fields, name))
    if unknown:
        raise SettingsError("; ".join(unknown))


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The settings models a field's type holds (itself, or a union's members)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]
