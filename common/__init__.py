"""Small helpers every package may use (no ragblend imports here)."""
from common.files import atomic_path, write_atomic

__all__ = ["atomic_path", "write_atomic"]
