"""The store's own settings (the app nests them under `store`)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class StoreSettings(BaseModel):
    codec: Literal["fp16", "int8"] = "fp16"
    memory_bytes: int = Field(512 << 20, ge=0)
    disk_bytes: int = Field(4 << 30, ge=0)
    redis_url: str | None = None
    redis_password: str | None = None
    redis_prefix: str = "ragblend:"
    redis_ttl_s: int | None = None
    redis_timeout_s: float = 0.5
    redis_backoff_s: float = 5.0
    redis_queue_size: int = 256
