"""The base of every settings model: a key no model declares is an error, never silently ignored (a misspelt
`blend: {ratoi: 0.2}` would otherwise load as the default ratio). app/config.py words the error."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """A settings model that refuses unknown keys (pydantic's `extra_forbidden`)."""

    model_config = ConfigDict(extra="forbid")
