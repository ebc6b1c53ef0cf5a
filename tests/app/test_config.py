"""Settings precedence, the compose file against the settings, the CLI's error paths."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from pydantic import BaseModel

from app.cli.main import main
from app.config import ENV_NESTED_DELIMITER, ENV_PREFIX, Settings, load_settings

REPO = Path(__file__).resolve().parents[2]


def test_precedence_defaults_then_config_file_then_env(tmp_path, monkeypatch):
    assert load_settings().blend.ratio == 0.15  # configs/default.yaml
    config = tmp_path / "c.yaml"
    config.write_text("blend:\n  ratio: 0.3\n  check_layer: 2\nserver:\n  port: 9001\n")
    from_file = load_settings(config)
    assert (from_file.blend.ratio, from_file.blend.check_layer, from_file.server.port) == (0.3, 2, 9001)
    assert from_file.blend.deviation == "value"  # untouched keys keep their defaults
    monkeypatch.setenv("RAGBLEND_BLEND__RATIO", "0.5")
    monkeypatch.setenv("RAGBLEND_DATA_DIR", str(tmp_path / "d"))
    from_env = load_settings(config)
    assert from_env.blend.ratio == 0.5 and from_env.blend.check_layer == 2
    assert from_env.data_dir == tmp_path / "d" and from_env.kv_dir == tmp_path / "d" / "kv"


def test_invalid_values_are_rejected(tmp_path, monkeypatch):
    monkeypatch.setenv("RAGBLEND_BLEND__RATIO", "1.5")
    with pytest.raises(ValueError, match="ratio"):
        load_settings()
    monkeypatch.delenv("RAGBLEND_BLEND__RATIO")
    bad = tmp_path / "bad.yaml"
    bad.write_text("blend: [1, 2\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_settings(bad)
    with pytest.raises(ValueError, match="not found"):
        load_settings(tmp_path / "missing.yaml")
    with pytest.raises(ValueError, match="unknown selection policy 'best'.*hkvd"):
        load_settings(blend={"selection": "best"})
    with pytest.raises(ValueError, match="check_layer"):
        load_settings(blend={"check_layer": -1})


def test_check_layer_beyond_the_model_is_a_config_error(tmp_path, smollm):
    from app.components import Components

    for layer, ok in [(0, True), (28, True), (29, False), (30, False)]:
        parts = Components(load_settings(data_dir=tmp_path, blend={"check_layer": layer}))
        parts.llm = smollm
        if ok:
            assert parts.blender.check_layer == layer
        else:
            with pytest.raises(ValueError, match=r"invalid blend settings: check_layer must be in \[0, 28\] .*got "
                                                  f"{layer}"):
                parts.blender


def _env_names(model: type, prefix: str) -> set[str]:
    """Every environment variable the settings read, e.g. RAGBLEND_STORE__REDIS_URL."""
    names = set()
    for name, field in model.model_fields.items():
        sub = field.annotation
        if isinstance(sub, type) and hasattr(sub, "model_fields"):
            names |= _env_names(sub, f"{prefix}{name.upper()}{ENV_NESTED_DELIMITER}")
        else:
            names.add(f"{prefix}{name.upper()}")
    return names


def test_compose_file_matches_settings(monkeypatch):
    """Two replicas behind nginx, sharing PostgreSQL and a bounded Redis: names, env, health, volumes."""
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"app-1", "app-2", "lb", "postgres", "redis"}
    assert all("healthcheck" in service for service in services.values())
    apps = [services["app-1"], services["app-2"]]
    assert apps[0]["environment"] == apps[1]["environment"]
    env = apps[0]["environment"]
    assert set(env) <= _env_names(Settings, ENV_PREFIX), "compose sets env vars the app does not read"
    for name, value in env.items():
        monkeypatch.setenv(name, str(value))
    settings = load_settings()

    # The service names resolve inside compose; the database is the one postgres creates.
    database = urlsplit(settings.retrieval.database_url)
    postgres = services["postgres"]
    assert database.scheme == "postgresql" and (database.hostname, database.port) == ("postgres", 5432)
    pg_env = postgres["environment"]
    assert (database.username, database.password, database.path[1:]) == \
        (pg_env["POSTGRES_USER"], pg_env["POSTGRES_PASSWORD"], pg_env["POSTGRES_DB"])
    assert "pg_isready" in postgres["healthcheck"]["test"]
    assert any(v.endswith(":/var/lib/postgresql/data") for v in postgres["volumes"])
    redis_url = urlsplit(settings.store.redis_url)
    assert (redis_url.scheme, redis_url.hostname) == ("redis", "redis")

    # Redis is a bounded LRU cache that never evicts a leased entry: under volatile-lru only keys with a TTL
    # are candidates, every unleased entry gets one (redis_ttl_s) and a leased one has none (PERSIST). Under
    # allkeys-lru Redis could evict a leased entry; without a TTL on unleased ones it could evict nothing.
    redis = services["redis"]
    command = redis["command"]
    assert redis["image"].startswith("redis") and command[0] == "redis-server"
    maxmemory = command[command.index("--maxmemory") + 1]
    assert maxmemory not in ("0", "0b")
    assert command[command.index("--maxmemory-policy") + 1] == "volatile-lru"
    assert settings.store.redis_ttl_s and settings.store.redis_ttl_s > 0
    assert settings.store.redis_pinned_bytes < int(maxmemory.removesuffix("gb")) * 2**30
    assert "ping" in redis["healthcheck"]["test"]

    # Each replica: built from this repo, its own data volume, waits for healthy dependencies,
    # healthy once /health answers on the port it serves.
    port = settings.server.port
    assert settings.server.host == "0.0.0.0"
    data_volumes = set()
    for app in apps:
        assert app["build"] == "." and "ports" not in app  # reached through the load balancer only
        assert {name: dep["condition"] for name, dep in app["depends_on"].items()} == \
            {"postgres": "service_healthy", "redis": "service_healthy"}
        [volume] = [v for v in app["volumes"] if v.endswith(f":{settings.data_dir}")]
        data_volumes.add(volume.split(":")[0])
        assert f"127.0.0.1:{port}/health" in " ".join(app["healthcheck"]["test"])
    assert len(data_volumes) == 2 and data_volumes <= set(compose["volumes"])

    # The load balancer: nginx, in front of exactly the two replicas.
    lb = services["lb"]
    assert lb["image"].startswith("nginx:") and set(lb["depends_on"]) == {"app-1", "app-2"}
    [mount] = [v for v in lb["volumes"] if v.endswith(":/etc/nginx/nginx.conf:ro")]
    nginx = (REPO / mount.split(":")[0]).read_text()
    assert sorted(re.findall(r"^\s*server\s+([\w.-]+:\d+)", nginx, re.MULTILINE)) == \
        [f"app-1:{port}", f"app-2:{port}"]
    assert "proxy_buffering off" in nginx  # streamed answers
    body_limit = int(re.search(r"client_max_body_size\s+(\d+)m;", nginx).group(1)) << 20
    assert body_limit >= settings.limits.max_body_bytes
    listen = re.search(r"listen\s+(\d+);", nginx).group(1)
    assert lb["ports"] == [f"{port}:{listen}"]


def test_dockerfile_copies_every_package():
    dockerfile = (REPO / "Dockerfile").read_text()
    packages = re.search(r"include = \[([^]]*)\]", (REPO / "pyproject.toml").read_text()).group(1)
    for package in re.findall(r'"(\w+)\*"', packages):
        assert f"COPY {package} {package}" in dockerfile, f"the image lacks the {package} package"


def test_database_url_must_name_a_known_database(monkeypatch):
    monkeypatch.setenv("RAGBLEND_RETRIEVAL__DATABASE_URL", "mysql://u:p@h/db")
    with pytest.raises(ValueError, match="postgresql://"):
        load_settings()
    monkeypatch.setenv("RAGBLEND_RETRIEVAL__DATABASE_URL", "postgresql://u:p@db:5432/rag")
    assert load_settings().retrieval.database_url == "postgresql://u:p@db:5432/rag"


@pytest.mark.parametrize("args, message", [
    (["frobnicate"], "No such command"),
    (["ask"], "Missing argument"),
    (["compare", "--dataset", "/nonexistent.json"], "does not exist"),
    (["ask", "q", "--ratio", "2"], "--ratio"),
    (["ask", "q", "--mode", "fast"], "unknown mode"),
    (["ingest"], "give at least one PATH"),
    (["bench", "nosuch"], "unknown benchmark"),
])
def test_cli_bad_arguments_exit_nonzero_with_a_reason(args, message, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["ragblend", *args])
    with pytest.raises(SystemExit) as exit_info:
        main()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.startswith("error:") and message in err and len(err.strip().splitlines()) == 1


def test_cli_bad_config_is_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("blend:\n  ratio: 7\n")
    result = subprocess.run([sys.executable, "-m", "app.cli.main", "store", "stats", "--config", str(bad)],
                            capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 2
    assert result.stderr.startswith("error:") and len(result.stderr.strip().splitlines()) == 1


def test_blend_ratio_is_a_share_or_auto(tmp_path):
    from app.config import load_settings

    assert load_settings(data_dir=tmp_path, blend={"ratio": "auto"}).blend.ratio == "auto"
    assert load_settings(data_dir=tmp_path, blend={"ratio": 0.3}).blend.ratio == 0.3
    for bad in ("fast", 1.5):
        with pytest.raises(ValueError):
            load_settings(data_dir=tmp_path, blend={"ratio": bad})


def test_config_validates_device_and_dtype(tmp_path):
    # (moved from tests/blend/test_device.py: the blend tests import nothing from app)
    settings = load_settings(data_dir=tmp_path, model={"device": "cuda:1", "dtype": "auto"})
    assert (settings.model.device, settings.model.dtype) == ("cuda:1", "auto")
    with pytest.raises(ValueError, match="model.device must be"):
        load_settings(data_dir=tmp_path, model={"device": "gpu"})


def test_the_settings_defaults_are_the_documented_ones():
    """configs/default.yaml documents every default; the settings classes hold the same ones (one default each)."""
    documented, built_in = load_settings().model_dump(), Settings().model_dump()
    assert built_in == documented


def _models(model: type[BaseModel]) -> set[type[BaseModel]]:
    """`model` and every settings model nested in it."""
    from app.config import _models_in

    found = {model}
    for field in model.model_fields.values():
        for nested in _models_in(field.annotation):
            found |= _models(nested)
    return found


def test_every_settings_model_refuses_unknown_keys():
    models = _models(Settings)
    assert {"BlendSettings", "StoreSettings", "TierCodecs", "CacheGenBins", "RetrievalSettings"} <= \
        {m.__name__ for m in models}
    assert all(m.model_config.get("extra") == "forbid" for m in models), \
        [m.__name__ for m in models if m.model_config.get("extra") != "forbid"]


@pytest.mark.parametrize("yaml_text, message", [
    ("blend: {ratoi: 0.2}\n", "blend.ratoi: unknown setting; did you mean blend.ratio?"),
    ("store: {codec: {gpux: int4}}\n", "store.codec.gpux: unknown setting; did you mean store.codec.gpu?"),
    ("store: {cachegen_bins: {keyz: [[0, 16]]}}\n",
     "store.cachegen_bins.keyz: unknown setting; did you mean store.cachegen_bins.keys?"),
    ("retrieval: {topk: 3}\n", "retrieval.topk: unknown setting; did you mean retrieval.top_k?"),
    ("severs: {port: 1}\n", "severs: unknown setting; did you mean server?"),
])
def test_an_unknown_key_in_yaml_names_the_nearest_one(tmp_path, yaml_text, message):
    config = tmp_path / "c.yaml"
    config.write_text(yaml_text)
    with pytest.raises(ValueError) as error:
        load_settings(config)
    assert str(error.value) == message


@pytest.mark.parametrize("variable, message", [
    ("RAGBLEND_BLEND__RATOI", "blend.ratoi: unknown setting (from RAGBLEND_BLEND__RATOI); did you mean blend.ratio?"),
    ("RAGBLEND_STORE__CODEC__MEMROY", "store.codec.memroy: unknown setting (from RAGBLEND_STORE__CODEC__MEMROY); "
                                      "did you mean store.codec.memory?"),
    ("RAGBLEND_BLNED__RATIO", "blned: unknown setting (from RAGBLEND_BLNED__RATIO); did you mean blend?"),
    ("RAGBLEND_DATA_DIRR", "data_dirr: unknown setting (from RAGBLEND_DATA_DIRR); did you mean data_dir?"),
])
def test_an_unknown_environment_variable_names_the_nearest_setting(monkeypatch, variable, message):
    monkeypatch.setenv(variable, "0.2" if "CODEC" not in variable else "int4")
    with pytest.raises(ValueError) as error:
        load_settings()
    assert str(error.value) == message


def test_other_tools_variables_and_known_settings_still_load(monkeypatch):
    monkeypatch.setenv("RAGBLEND_LOG_LEVEL", "INFO")  # not a setting, nor close to one: left to its reader
    monkeypatch.setenv("RAGBLEND_STORE__CODEC__DISK", "int4")
    assert load_settings().store.codec_of("disk") == "int4"


def test_every_key_of_the_default_config_is_a_setting():
    documented = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())

    def leaves(values: dict, path: tuple = ()) -> list[tuple]:
        return [leaf for key, value in values.items()
                for leaf in (leaves(value, (*path, key)) if isinstance(value, dict) and key != "api_keys"
                             else [(*path, key)])]
    loaded = load_settings().model_dump()
    for path in leaves(documented):
        node = loaded
        for key in path:
            node = node[key]  # KeyError: a documented key the settings do not hold
    assert len(leaves(documented)) > 50


def test_cli_unknown_setting_is_one_line_with_the_nearest_key(tmp_path):
    result = subprocess.run([sys.executable, "-m", "app.cli.main", "store", "stats"], capture_output=True, text=True,
                            cwd=REPO, env={**os.environ, "RAGBLEND_BLEND__RATOI": "0.2", "PYTHONPATH": str(REPO)})
    assert result.returncode == 2
    assert result.stderr == ("error: blend.ratoi: unknown setting (from RAGBLEND_BLEND__RATOI); "
                             "did you mean blend.ratio?\n")
