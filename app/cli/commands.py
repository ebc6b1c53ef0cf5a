"""What the `ragblend` commands run (app/cli/main.py parses their arguments): ingest, ask, compare and store gc,
over the parts app/components.py builds. Each returns the command's exit code."""
from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from app.cli.compare import (
    REPORT_JSON,
    CompareConfig,
    Harness,
    build_report,
    load_dataset,
    load_previous,
    run_identity,
    warm_up,
    write_outputs,
)
from app.components import Components
from app.config import Settings
from app.engine.ingest import IngestError, Ingestor, SourceDocument, collect_files, read_documents
from app.engine.query import QueryParams
from app.engine.rag_engine import RagEngine
from blend.selection import get_policy
from common import git_commit
from retrieval import IndexMismatchError

log = logging.getLogger("ragblend.ingest")
log_compare = logging.getLogger("ragblend.compare")


# ---- ragblend ingest ----------------------------------------------------------------------------

@dataclass
class _Summary:
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("added", "updated", "unchanged", "deleted", "failed"), 0))
    chunks: int = 0

    def error(self, message: str) -> None:
        from tqdm import tqdm

        self.counts["failed"] += 1
        tqdm.write(f"error: {message}", file=sys.stderr)  # tqdm.write keeps the progress bars intact

    def line(self, seconds: float, precomputed: bool = True) -> str:
        c = self.counts
        work = "embedded and precomputed" if precomputed else "embedded (KV computed at first use)"
        return (f"ingest: {c['added']} added, {c['updated']} updated, {c['unchanged']} unchanged, "
                f"{c['deleted']} deleted, {c['failed']} failed; {self.chunks} chunks {work} in {seconds:.1f} s")


def run_ingest(settings: Settings, paths: list[Path], delete_ids: list[str], tenant: str = "") -> int:
    """`ragblend ingest`: 0 if all went well, 1 if any input or deletion failed, 2 if ingest could not start.
    `tenant` (retrieval.documents: tenant): the tenant whose collection it writes; "" the default tenant's, which is
    the shared collection under documents: shared."""
    start, summary = time.perf_counter(), _Summary()
    if tenant and (problem := _tenant_problem(settings, tenant)):
        summary.error(problem)
        return 2
    docs = _read_inputs(paths, summary)
    if docs or delete_ids:  # all inputs bad: report without loading any model
        try:
            with open_ingestor(settings, tenant) as ingestor:
                for doc_id in delete_ids:
                    try:
                        ingestor.delete(doc_id)
                        summary.counts["deleted"] += 1
                    except KeyError:
                        summary.error(f"--delete {doc_id}: unknown document id")
                _ingest_all(ingestor, docs, summary)
        except IndexMismatchError as exc:
            summary.error(str(exc))
            return 2
    print((f"tenant {tenant}: " if tenant else "") +
          summary.line(time.perf_counter() - start, settings.blend.precompute_at == "ingest"))
    return 1 if summary.counts["failed"] else 0


def _tenant_problem(settings: Settings, tenant: str) -> str | None:
    """Why documents cannot go to `tenant`'s collection (documents shared, or no such tenant), or None."""
    if settings.retrieval.documents != "tenant":
        return f"--tenant {tenant}: retrieval.documents is shared (one collection for every tenant): leave --tenant out"
    known = sorted(set(settings.server.api_keys.values()))
    if tenant not in known:
        return f"--tenant {tenant}: no such tenant in server.api_keys (known: {', '.join(known) or 'none'})"
    return None


@contextmanager
def open_ingestor(settings: Settings, tenant: str = "") -> Iterator[Ingestor]:
    """An Ingestor over the configured model, store and index, writing `tenant`'s collection, closed on exit."""
    parts = Components(settings)
    try:
        yield replace(parts.ingestor, collection=settings.retrieval.collection(tenant))
    finally:
        parts.close()


def _read_inputs(paths: list[Path], summary: _Summary) -> list[SourceDocument]:
    """Every document of every input; bad files, lines and duplicate ids are reported and skipped."""
    files, errors = collect_files(paths)
    docs: list[SourceDocument] = []
    for path, doc_id in files:
        found, bad = read_documents(path, doc_id)
        docs += found
        errors += bad
    seen: dict[str, str] = {}
    unique = []
    for doc in docs:
        if doc.doc_id in seen:
            errors.append(f"{doc.source}: duplicate document id {doc.doc_id!r} (also in {seen[doc.doc_id]})")
        else:
            seen[doc.doc_id] = doc.source
            unique.append(doc)
    for message in errors:
        summary.error(message)
    return unique


def _ingest_all(ingestor: Ingestor, docs: list[SourceDocument], summary: _Summary) -> None:
    """Chunk everything first (so the progress bars know their totals), then embed, precompute, commit."""
    from tqdm import tqdm

    prepared = []
    for doc in docs:
        try:
            prepared.append(ingestor.prepare(doc))
        except IngestError as exc:
            summary.error(str(exc))
    total = sum(len(p.chunks) for p in prepared if not p.unchanged)
    with tqdm(total=total, desc="embedded", unit="chunk", file=sys.stderr, disable=None) as embedded, \
            tqdm(total=total, desc="KV precomputed", unit="chunk", file=sys.stderr,
                 disable=None if ingestor.precompute_at == "ingest" else True) as kv:
        ingestor.on_embedded, ingestor.on_precomputed = embedded.update, kv.update
        for item in prepared:
            try:
                result = ingestor.commit(item)
            except Exception as exc:  # one bad document must not stop the batch
                log.debug("ingest failed", extra={"source": item.doc.source}, exc_info=True)
                summary.error(f"{item.doc.source}: {type(exc).__name__}: {exc}")
                continue
            summary.counts[result.status] += 1
            if result.status != "unchanged":
                summary.chunks += result.n_chunks


# ---- ragblend ask -------------------------------------------------------------------------------

def run_ask(settings: Settings, question: str, *, top_k: int | None, mode: str, ratio: float | None,
            max_tokens: int | None) -> int:
    """`ragblend ask`: print the answer, its sources and timings."""
    engine = RagEngine(settings, Components(settings))
    for event in engine.stream(QueryParams(question, top_k=top_k, mode=mode, ratio=ratio, max_tokens=max_tokens)):
        if isinstance(event, str):
            sys.stdout.write(event)
            sys.stdout.flush()
        else:
            print("\n\nsources:")
            for src in event.sources:
                print(f"  [{src.score:.3f}] {src.doc_id}#{src.chunk_id} {src.title or ''}")
            s = event.stats
            print(f"\nmode={s.mode} ttft={s.ttft_ms:.0f}ms total={s.total_ms:.0f}ms prompt={s.prompt_tokens} "
                  f"cached={s.cached_tokens} recomputed={s.recomputed_tokens} store={s.store_hits}")
    engine.parts.close()
    return 0


# ---- ragblend store gc --------------------------------------------------------------------------

def run_store_gc(settings: Settings, min_idle_s: float | None) -> int:
    """`ragblend store gc`: per tier, entries of other models dropped (and what is left), and the entries of
    this model that no document, prompt head or running lease owns, removed unless read or written within
    `min_idle_s` (store.tiered.GC_MIN_IDLE_S by default): printed as JSON."""
    parts = Components(settings)
    try:
        idle = {} if min_idle_s is None else {"min_idle_s": min_idle_s}
        report = parts.store.gc(parts.llm.fingerprint, owned=parts.owned_keys, **idle)
    finally:
        parts.close()
    print(json.dumps(report, indent=2))
    return 0


# ---- ragblend compare ---------------------------------------------------------------------------

def run_compare(settings: Settings, dataset: Path, *, limit: int, passages: int, ratios: list[float], out: Path,
                precompute: str | None, codec: str | None, max_tokens: int, resume: bool, seed: int = 0,
                threads: int | None = None, progress: bool = True, selections: list[str] | None = None,
                start: int = 0) -> int:
    """The `ragblend compare` command; returns the exit code.

    `threads` sets torch's intra-op threads for the run (restored after): on a shared machine one
    thread times far more steadily than threads that wait on each other.
    """
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _run_compare(settings, dataset, limit=limit, passages=passages, ratios=ratios, out=out,
                            precompute=precompute, codec=codec, max_tokens=max_tokens, resume=resume, seed=seed,
                            progress=progress, selections=selections or [settings.blend.selection], start=start)
    finally:
        torch.set_num_threads(previous)


def _run_compare(settings: Settings, dataset: Path, *, limit: int, passages: int, ratios: list[float], out: Path,
                 precompute: str | None, codec: str | None, max_tokens: int, resume: bool, seed: int,
                 progress: bool, selections: list[str], start: int) -> int:
    from tqdm import tqdm

    # 1. Config, data, model.
    try:
        selections = [get_policy(s).name for s in selections]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        items = load_dataset(dataset, start + limit)
    except (OSError, ValueError) as exc:
        print(f"error: cannot read dataset: {exc}", file=sys.stderr)
        return 2
    codec = codec or settings.store.codec_of("disk")  # by default as the disk tier keeps passages
    config = CompareConfig(str(dataset), passages, sorted(set(ratios)), precompute or settings.blend.precompute,
                           codec, settings.blend.check_layer, settings.blend.deviation,
                           selections, max_tokens, seed, torch.get_num_threads(),
                           settings.store.cachegen_bins.plan().as_dict() if codec == "cachegen" else None)
    parts = Components(settings)
    try:
        harness = Harness(parts.blender, parts.runtime, parts.prompt, config)
    except ValueError as exc:  # e.g. a check layer this model cannot have
        print(f"error: {exc}", file=sys.stderr)
        return 2
    identity, commit = run_identity(parts.llm, config, harness.prompt), git_commit()
    # 2. Resume: keep the questions already answered under the same model, config and prompt.
    out.mkdir(parents=True, exist_ok=True)
    try:
        done = load_previous(out / REPORT_JSON, identity) if resume else []
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    done = [q for q in done if start <= q["index"] < len(items)]
    todo = [(i, item) for i, item in enumerate(items) if i >= start and i not in {q["index"] for q in done}]
    log_compare.info("compare started", extra={"config": asdict(config), "done": len(done), "todo": len(todo)})
    if todo:
        warm_up(harness)
    # 3. Each question: all modes back to back; the report rewritten after each.
    questions = list(done)
    with tqdm(total=len(items) - start, initial=len(done), desc="compare", unit="q", file=sys.stderr,
              disable=not progress) as bar:
        for index, item in todo:
            start = time.perf_counter()
            result = harness.run(index, item) | {"commit": commit}
            questions.append(result)
            write_outputs(out, build_report(identity, harness.modes, questions, commit), final=False)
            log_compare.info("question done", extra={"index": index, "seconds": round(time.perf_counter() - start, 1),
                                             "ttft_ratio": {m: round(r["ttft_ratio"], 3)
                                                            for m, r in result["modes"].items()}})
            bar.update(1)
    # 4. Aggregate table and plot.
    report = build_report(identity, harness.modes, questions, commit)
    write_outputs(out, report, final=True)
    log_compare.info("compare finished", extra={"out": str(out), "questions": len(questions)})
    return 0
