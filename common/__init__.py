"""Small helpers every package may use (no ragblend imports here)."""
from common.files import atomic_path, write_atomic
from common.provenance import git_commit

__all__ = ["atomic_path", "git_commit", "write_atomic"]
