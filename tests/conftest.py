"""Shared fixtures: paths, settings in a temp data dir, the real embedded model (loaded once)."""
from __future__ import annotations

import atexit
import json
import logging
import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings

# Every run replays the same examples, in CI and in a fresh clone's `make test` alike: a red build is
# then a real regression, not a new draw. `pytest --hypothesis-profile=explore` draws new ones (and
# keeps the failures it finds in .hypothesis/). Neither times examples: a loaded machine is not a bug.
_untimed = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
hypothesis_settings.register_profile("repeatable", derandomize=True, database=None, **_untimed)
hypothesis_settings.register_profile("explore", **_untimed)
hypothesis_settings.load_profile("repeatable")


# The suite leaves daemon threads behind (apps' model threads and ingest lanes over the shared engine,
# KV loaders). One inside a torch call when the interpreter tears down is ended by pthread_exit in a
# C++ frame, and the process aborts after every test passed ("terminate called without an active
# exception", pytorch/pytorch#38228). So after the other exit handlers (this one is registered before
# theirs but logging's, so it runs last), the process ends with pytest's status, without that teardown.
_session: pytest.Session | None = None


def pytest_sessionfinish(session: pytest.Session) -> None:
    global _session
    _session = session


@atexit.register
def _exit_before_the_interpreter_teardown() -> None:
    if _session is not None:
        logging.shutdown()  # the one exit handler registered before this one
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(_session.exitstatus))


REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data" / "musique_dev.json"
MODEL_CACHE = REPO / "data" / "models"  # converted once by `make models`; shared by all tests


@pytest.fixture(scope="session")
def musique() -> list[dict]:
    if not SHARED_DATA.exists():
        pytest.skip(f"real data not found at {SHARED_DATA}")
    return json.loads(SHARED_DATA.read_text())


@pytest.fixture(scope="session")
def smollm():
    """The real embedded SmolLM2-135M-Instruct (LoadedModel), shared by the whole session."""
    from blend import load_model

    device = os.environ.get("RAGBLEND_TEST_DEVICE", "cpu")
    if device != "cpu" and not MODEL_CACHE.exists():  # a GPU machine gets the checkout, not the converted model
        pytest.skip(f"the embedded model is not on this machine ({MODEL_CACHE})")
    return load_model("embedded", cache_dir=MODEL_CACHE, device=device)


@pytest.fixture
def settings(tmp_path):
    from app.config import load_settings

    return load_settings(data_dir=tmp_path / "data", model={"cache_dir": str(MODEL_CACHE)})


@pytest.fixture(scope="session")
def postgres_server():
    """One throwaway PostgreSQL cluster per session (tests.servers.PostgresServer)."""
    from tests.servers import PostgresServer, postgres_bin

    if postgres_bin() is None:
        pytest.skip("PostgreSQL not installed (apt-get install postgresql)")
    with PostgresServer() as server:
        yield server


@pytest.fixture
def postgres_url(postgres_server) -> str:
    """The URL of a new, empty PostgreSQL database."""
    return postgres_server.database()


@pytest.fixture(scope="session")
def redis_server():
    """One real redis-server for the session (restartable: tests.servers.RedisServer)."""
    import shutil

    from tests.servers import RedisServer  # here: the GPU machine's blend tests need no redis package

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed (apt-get install redis-server)")
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server) -> str:
    """URL of a running, empty Redis (restarted if a previous test killed or froze it)."""
    if redis_server.running:
        redis_server.resume()
    else:
        redis_server.start()
    with redis_server.client() as client:
        client.flushall()
    return redis_server.url
