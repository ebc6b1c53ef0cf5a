"""Store test fixtures: one real redis-server per session (restartable), random ChunkKVs."""
from __future__ import annotations

import shutil

import pytest

from tests.servers import RedisServer


@pytest.fixture(scope="session")
def redis_server():
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed (apt-get install redis-server)")
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """URL of a running, empty Redis (restarted if a previous test killed or froze it)."""
    if redis_server.running:
        redis_server.resume()
    else:
        redis_server.start()
    with redis_server.client() as client:
        client.flushall()
    return redis_server.url
