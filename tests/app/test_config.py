"""Settings precedence, the compose file against the settings, the CLI's error paths."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from app.cli import main
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
    from app.components import build_blender

    for layer, ok in [(0, True), (28, True), (29, False), (30, False)]:
        settings = load_settings(data_dir=tmp_path, blend={"check_layer": layer})
        if ok:
            assert build_blender(settings, smollm).check_layer == layer
        else:
            with pytest.raises(ValueError, match=r"invalid blend settings: check_layer must be in \[0, 28\] .*got "
                                                  f"{layer}"):
                build_blender(settings, smollm)


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
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"app", "redis"}
    app, redis = services["app"], services["redis"]
    assert app["build"] == "." and (REPO / "Dockerfile").exists()
    env = app["environment"]
    assert set(env) <= _env_names(Settings, ENV_PREFIX), "compose sets env vars the app does not read"
    for name, value in env.items():
        monkeypatch.setenv(name, str(value))
    settings = load_settings()
    assert settings.store.redis_url.startswith("redis://redis:")  # the service name resolves in compose
    assert f"{settings.server.port}:{settings.server.port}" in app["ports"]
    assert any(v.endswith(f":{settings.data_dir}") for v in app["volumes"]), "data dir must be a volume"
    assert "redis" in app["depends_on"]
    assert redis["image"].startswith("redis") and "--appendonly" in redis["command"]
    assert redis["command"][redis["command"].index("--appendonly") + 1] == "yes"
    assert any(v.endswith(":/data") for v in redis["volumes"])


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
    result = subprocess.run([sys.executable, "-m", "app.cli", "store", "stats", "--config", str(bad)],
                            capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 2
    assert result.stderr.startswith("error:") and len(result.stderr.strip().splitlines()) == 1
