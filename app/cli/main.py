"""`ragblend` command line: ingest, serve, ask, compare, bench, store."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from typer._click.exceptions import UsageError  # typer vendors click; this is its UsageError

from app.config import Settings, load_settings

cli = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  rich_markup_mode=None, help="RAG serving with CacheBlend-style KV reuse.")
store_cli = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Inspect and clean the tiered KV store.")
cli.add_typer(store_cli, name="store")

ConfigOpt = typer.Option(None, "--config", "-c", help="YAML file overriding configs/default.yaml.")


def _settings(config: Optional[Path]) -> Settings:
    from app.logs import setup_logging

    try:
        settings = load_settings(config)
    except ValueError as exc:  # bad file or invalid values
        fail(" ".join(str(exc).split()))  # pydantic's multi-line message, on one line
    setup_logging()
    return settings


def fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


@cli.command()
def ingest(paths: list[Path] = typer.Argument(None, help="Files or folders (.txt, .md, .jsonl)."),
           delete: list[str] = typer.Option([], "--delete", help="Remove a document by id (repeatable)."),
           tenant: str = typer.Option("", "--tenant", help="With retrieval.documents: tenant, the tenant (a name "
                                      "in server.api_keys) whose documents these are; without it the default "
                                      "tenant's (with documents: shared, the one shared collection)."),
           config: Optional[Path] = ConfigOpt) -> None:
    """Chunk, embed and index documents, and precompute each chunk's KV into the store."""
    from app.cli.commands import run_ingest

    if not paths and not delete:
        fail("give at least one PATH or --delete DOC_ID")
    raise typer.Exit(run_ingest(_settings(config), paths or [], delete, tenant))


@cli.command()
def serve(host: Optional[str] = typer.Option(None), port: Optional[int] = typer.Option(None),
          config: Optional[Path] = ConfigOpt) -> None:
    """Start the HTTP API."""
    from app.api.server import run_server

    settings = _settings(config)
    run_server(settings, host or settings.server.host, port if port is not None else settings.server.port)


@cli.command()
def ask(question: str, top_k: Optional[int] = typer.Option(None, min=1),
        mode: str = typer.Option("blend", help="blend | full | reuse | prefix"),
        ratio: Optional[float] = typer.Option(None, min=0.0, max=1.0, help="Recompute ratio."),
        max_tokens: Optional[int] = typer.Option(None, min=1),
        config: Optional[Path] = ConfigOpt) -> None:
    """Answer one question with the same engine as the API, without HTTP."""
    from app.cli.commands import run_ask

    if mode not in ("blend", "full", "reuse", "prefix"):
        fail(f"unknown mode {mode!r}: use blend, full, reuse or prefix")
    settings = _settings(config)
    try:
        code = run_ask(settings, question, top_k=top_k, mode=mode, ratio=ratio, max_tokens=max_tokens)
    except ValueError as exc:  # invalid blend settings for this model, a prompt too long
        fail(str(exc))
    raise typer.Exit(code)


@cli.command()
def compare(dataset: Path = typer.Option(..., exists=True, dir_okay=False, help="MuSiQue/CacheBlend-format JSON."),
            limit: int = typer.Option(20, min=1), passages: int = typer.Option(5, min=1),
            ratios: str = typer.Option("0,0.15,0.3,1", help="Comma-separated recompute ratios."),
            out: Path = typer.Option(Path("reports/compare")),
            precompute: Optional[str] = typer.Option(None, help="head | zero (default: config)."),
            codec: Optional[str] = typer.Option(
                None, help="none | native | fp16 | int8 | int4 | cachegen: pass chunk KV through a store "
                           "codec (cachegen: its bins from store.cachegen_bins; default: the disk tier's)."),
            max_tokens: int = typer.Option(32, min=1), resume: bool = typer.Option(False),
            seed: int = typer.Option(0, help="Seed of the random-selection baseline (plus the question index)."),
            threads: Optional[int] = typer.Option(None, min=1, help="torch threads for the run (default: torch's)."),
            selection: Optional[str] = typer.Option(
                None, help="Comma-separated selection policies (default: blend.selection); hkvd and random "
                           "always run."),
            start: int = typer.Option(0, min=0, help="First question (index) of the dataset to run."),
            config: Optional[Path] = ConfigOpt) -> None:
    """Compare blended answers with full prefill (quality and TTFT) on a dataset."""
    from app.cli.commands import run_compare

    try:
        ratio_list = [float(r) for r in ratios.split(",") if r.strip()]
    except ValueError:
        fail(f"--ratios must be comma-separated numbers, got {ratios!r}")
    if not ratio_list or any(not 0.0 <= r <= 1.0 for r in ratio_list):
        fail("--ratios must be numbers in [0, 1]")
    if precompute not in (None, "head", "zero"):
        fail(f"unknown --precompute {precompute!r}: use head or zero")
    from store import CODEC_NAMES

    if codec not in (None, "none", *CODEC_NAMES):
        fail(f"unknown --codec {codec!r}: use none, {', '.join(CODEC_NAMES)}")
    raise typer.Exit(run_compare(_settings(config), dataset, limit=limit, passages=passages, ratios=ratio_list,
                                 out=out, precompute=precompute, codec=codec, max_tokens=max_tokens,
                                 resume=resume, seed=seed, threads=threads, start=start,
                                 selections=[s.strip() for s in (selection or "").split(",") if s.strip()] or None))


@cli.command()
def bench(name: str = typer.Argument(..., help="ttft | store | ingest | serve | scale"),
          args: list[str] = typer.Argument(None, help="Arguments passed to the script.")) -> None:
    """Run a benchmark script from bench/ (prints JSON)."""
    import runpy

    script = Path(__file__).resolve().parent.parent / "bench" / f"{name}.py"
    if not script.exists():
        fail(f"unknown benchmark {name!r}: choose from ttft, store, ingest, serve, scale")
    sys.argv = [str(script), *(args or [])]
    runpy.run_path(str(script), run_name="__main__")


@store_cli.command("stats")
def store_stats(config: Optional[Path] = ConfigOpt) -> None:
    """Hit rate and where retrieved chunks' KV came from (all replicas), bytes per tier (no model is loaded)."""
    from app.components import Components
    from app.engine.usage import store_report

    parts = Components(_settings(config))
    try:
        with parts.inspect_store() as store:
            report = store_report(store.stats(), parts.metadata.usage())
        typer.echo(json.dumps(report, indent=2, default=str))
    finally:
        parts.close()


@store_cli.command("gc")
def store_gc(min_idle_s: Optional[float] = typer.Option(
                 None, "--min-idle-s", min=0,
                 help="Keep unowned entries read or written this recently (default 3600: what a running "
                      "server is about to use; an upload's entries before its commit)."),
             config: Optional[Path] = ConfigOpt) -> None:
    """Drop entries of other model fingerprints, and KV entries no document, prompt head or lease owns."""
    from app.cli.commands import run_store_gc

    raise typer.Exit(run_store_gc(_settings(config), min_idle_s))


def main() -> None:
    """Entry point: bad arguments get one line on stderr and exit code 2."""
    try:
        code = cli(standalone_mode=False)
    except UsageError as exc:
        bare_help = type(exc).__name__ == "NoArgsIsHelpError"
        typer.echo(exc.format_message() if bare_help else f"error: {exc.format_message()}", err=True)
        sys.exit(2)
    except typer.Abort:
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
