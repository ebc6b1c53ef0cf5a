"""Atomic file and folder writes: readers see the old version or the new one, never half of one."""
from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling of `path` to write (a file or a folder); on success it replaces `path`.

    The temporary name is unique per call, so concurrent writers never share one; on failure it is
    removed and `path` is left as it was. A folder replaces an existing folder in two renames (the
    old one is moved aside first): a crash between them leaves no folder, never a half-written one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        yield tmp
        if tmp.is_dir() and path.is_dir():
            old = tmp.with_suffix(".old")
            path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write `data` (text as UTF-8) to `path` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
