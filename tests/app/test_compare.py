"""`ragblend compare` end to end on the embedded model: report structure, invariants, resume.

Runs 2 MuSiQue questions × 3 passages (each passage cut to a few sentences so it stays fast)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.cli.answer_metrics import answer_scores, exact_match, f1_score, lcs_length, normalize_answer, rouge_l
from app.cli.commands import run_compare
from app.cli.compare import REPORT_JSON, build_modes
from app.config import load_settings

REPO = Path(__file__).resolve().parents[2]
MUSIQUE = REPO.parent / "shared" / "data" / "musique_dev.json"
RATIOS = [0.0, 0.5, 1.0]
MODES = ["full", "reuse", "query@0.5", "hkvd@0.5", "random@0.5", "blend@1"]
QUALITY = ("kl", "top1", "same_answer", "f1", "em", "rouge_l", "ttft_s", "ttft_ratio")


# ---- answer metrics -----------------------------------------------------------------------------

def test_squad_normalisation_and_scores():
    assert normalize_answer("The  Exeter College!") == "exeter college"
    assert exact_match("the exeter college.", "Exeter College") == 1.0
    assert f1_score("at Exeter College, Oxford", "Exeter College") == pytest.approx(2 / 3)
    assert f1_score("", "x") == 0.0 and f1_score("the", "a") == 1.0  # both empty after normalisation
    assert lcs_length("a b c d e".split(), "b x d e".split()) == 3
    assert rouge_l("the cat sat on mat", "cat on the mat") == pytest.approx(2 * 0.75 / 1.75)
    assert answer_scores("Paris", ["London", "paris"]) == {"f1": 1.0, "em": 1.0, "rouge_l": 1.0}


def test_modes():
    assert [m.name for m in build_modes([1, 0.15, 0, 0.3])] == [
        "full", "reuse", "hkvd@0.15", "hkvd@0.3", "random@0.15", "random@0.3", "blend@1"]
    modes = build_modes([0.15], ["query", "hybrid"])
    assert [(m.name, m.selection) for m in modes] == [
        ("full", "hkvd"), ("query@0.15", "query"), ("hybrid@0.15", "hybrid"), ("hkvd@0.15", "hkvd"),
        ("random@0.15", "random")]


# ---- the harness on the real model -------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_dataset(tmp_path_factory) -> Path:
    if not MUSIQUE.exists():
        pytest.skip(f"shared evaluation data missing: {MUSIQUE}")
    items = json.loads(MUSIQUE.read_text())[:2]
    for item in items:
        item["ctxs"] = [{**c, "text": c["text"][:400]} for c in item["ctxs"][:3]]
    path = tmp_path_factory.mktemp("data") / "tiny.json"
    path.write_text(json.dumps(items))
    return path


def compare(tmp_path: Path, dataset: Path, out: Path, limit: int, resume: bool = False, max_tokens: int = 8,
            expect: int = 0) -> dict:
    settings = load_settings(data_dir=tmp_path, model={"cache_dir": str(REPO / "data" / "models")})
    code = run_compare(settings, dataset, limit=limit, passages=3, ratios=RATIOS, out=out, precompute=None,
                       codec=None, max_tokens=max_tokens, resume=resume, progress=False, threads=1,
                       selections=["query"])
    assert code == expect
    return json.loads((out / REPORT_JSON).read_text())


def test_compare_report_and_resume(tmp_path, tiny_dataset, monkeypatch):
    out = tmp_path / "report"
    first = compare(tmp_path, tiny_dataset, out, limit=1)
    report = compare(tmp_path, tiny_dataset, out, limit=2, resume=True)

    # Structure: model, config, commit, per-question and aggregate results of every mode.
    assert report["model"]["fingerprint"] and report["commit"] and report["prompt"]["head_hash"]
    assert {k: report["config"][k] for k in ("ratios", "passages", "precompute", "codec", "check_layer",
                                             "deviation", "selections")} == {
        "ratios": RATIOS, "passages": 3, "precompute": "head", "codec": "int8", "check_layer": 1,
        "deviation": "value", "selections": ["query"]}
    assert [q["index"] for q in report["questions"]] == [0, 1]
    assert set(report["aggregate"]) == set(MODES)
    for q in report["questions"]:
        assert set(q["modes"]) == set(MODES) and q["reference_tokens"] >= 1
        for result in q["modes"].values():
            assert 0.0 <= result["f1"] <= 1.0 and result["em"] in (0.0, 1.0) and 0.0 <= result["rouge_l"] <= 1.0
            assert 0.0 <= result["top1"] <= 1.0 and result["kl"] >= 0.0 and result["same_answer"] in (0.0, 1.0)
            assert result["ttft_s"] > 0
    for name, agg in report["aggregate"].items():
        assert set(QUALITY) <= set(agg) and agg["n"] == 2, name

    # Invariants: full prefill is the reference; ratio 1 reproduces it.
    full, exact = report["aggregate"]["full"], report["aggregate"]["blend@1"]
    assert full["kl"] == 0.0 and full["top1"] == 1.0 and full["ttft_ratio"] == 1.0
    assert exact["kl"] < 1e-4 and exact["top1"] == 1.0 and exact["same_answer"] == 1.0
    for q in report["questions"]:
        assert q["modes"]["reuse"]["recomputed_tokens"] == 0
        recomputed = {q["modes"][m]["recomputed_tokens"] for m in ("query@0.5", "hkvd@0.5", "random@0.5")}
        assert len(recomputed) == 1 and recomputed.pop() > 0
    # Win counts against hkvd at the same ratio, checked against the per-question KLs.
    wins = sum(q["modes"]["query@0.5"]["kl"] < q["modes"]["hkvd@0.5"]["kl"] for q in report["questions"])
    assert report["aggregate"]["query@0.5"]["wins_vs_hkvd"] == wins
    assert "wins_vs_hkvd" not in report["aggregate"]["hkvd@0.5"]

    # Outputs a person reads.
    assert (out / "quality_vs_ttft.png").stat().st_size > 10_000
    assert "| query@0.5 |" in (out / "report.md").read_text()

    # Resume kept question 0 as measured; a second resume computes nothing.
    assert report["questions"][0] == first["questions"][0]

    def no_prefill(*args, **kwargs):
        raise AssertionError("resume recomputed a finished question")

    monkeypatch.setattr("app.cli.compare.Harness.run", no_prefill)
    monkeypatch.setattr("app.cli.compare.warm_up", no_prefill)
    assert compare(tmp_path, tiny_dataset, out, limit=2, resume=True)["questions"] == report["questions"]
    # ...and refuses to mix in results of another config.
    compare(tmp_path, tiny_dataset, out, limit=2, resume=True, max_tokens=4, expect=2)


def test_the_cli_names_every_store_codec_when_it_refuses_one(tmp_path):
    from typer.testing import CliRunner

    from app.cli.main import cli

    dataset = tmp_path / "none.json"
    dataset.write_text("[]")
    result = CliRunner().invoke(cli, ["compare", "--dataset", str(dataset), "--codec", "bf8"])
    assert result.exit_code == 2 and "unknown --codec 'bf8': use none, native, fp16, int8" in result.output
