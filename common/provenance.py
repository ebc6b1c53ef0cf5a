"""Which code produced a measurement: reports and benchmarks record the commit next to their numbers."""
from __future__ import annotations

import subprocess
from pathlib import Path


def git_commit(cwd: Path = Path(__file__).resolve().parent) -> str:
    """The checkout's short commit hash, or "unknown" outside a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=cwd)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"
