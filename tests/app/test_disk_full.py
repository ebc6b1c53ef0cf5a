"""A full data disk is an answer: an upload that cannot write gets a 507 saying so (with Retry-After), nothing it
began stays on the disk, /health says degraded, and the same upload succeeds once space is freed. The data dir is
a small tmpfs (mounting needs root: skipped without it); the real embedded model."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.app.conftest import make_settings

pytestmark = pytest.mark.slow


@pytest.fixture
def small_disk(tmp_path: Path):
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)],
                                           capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(path: Path) -> None:
    """Write zeros to `path` until the disk has no space left."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * (1 << 16))
    except OSError:
        pass
    finally:
        os.close(fd)


def files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def test_an_upload_on_a_full_disk_is_a_507_and_leaves_nothing(small_disk, server_engine):
    from app.api.server import create_app
    from app.components import Components
    from app.engine.rag_engine import RagEngine

    settings = make_settings(small_disk / "data")
    parts = Components(settings)
    parts.llm, parts.embedder = server_engine.parts.llm, server_engine.parts.embedder
    doc = {"id": "tide", "title": "Tides", "text": "The tide at Port Velmar turns twice a day. " * 20}
    with TestClient(create_app(settings, RagEngine(settings, parts)), raise_server_exceptions=False) as client:
        assert client.post("/v1/documents", json={"id": "first", "text": "The lamp shines green."}).status_code == 201
        fill(small_disk / "filler")
        before = files(small_disk / "data")
        response = client.post("/v1/documents", json=doc)
        assert response.status_code == 507, response.text
        assert response.json()["error"]["code"] == "disk_full" and "disk is full" in response.json()["error"]["message"]
        assert int(response.headers["Retry-After"]) > 0
        after = files(small_disk / "data")
        assert set(after) <= set(before), set(after) - set(before)  # nothing the failed write began stays
        health = client.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert "disk is full" in health.json()["degraded"][0]
        assert client.get("/v1/documents/tide").status_code == 404

        (small_disk / "filler").unlink()
        assert client.post("/v1/documents", json=doc).status_code == 201
        assert client.delete("/v1/documents/tide").status_code == 200
