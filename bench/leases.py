"""A leased context under LRU churn: does it stay a full memory hit while unleased documents stream through?

For each of `leased` and `unleased`, in a fresh data dir (the model shared): `--passages` short documents are
ingested (their KV precomputed), and a question retrieves all of them (top_k = passages). The memory tier
holds the context and a little more (`--memory-slack` passages). Then:
1. the question is asked once (its prompt's keys: QueryResult.kv_keys), and with `leased` those keys are
   leased as a request with prompt_cache_retention 24h is (app.engine.prompt_cache.lease: soft, 24 h);
2. `--repeats` more asks: the first hit's TTFT (median);
3. churn: the KV of unleased documents worth `--churn` times the memory tier is computed and stored (as other
   requests and uploads would), with a progress bar;
4. the question again: the TTFT after churn, and where its passages came from (stats.store_hits); then
   `--repeats` more asks (memory hits either way: an unleased context was promoted back by (4)), for scale.
`ttft_after_over_hit` is (4) over (2): with the lease the context stays in memory (about 1); without it the
churn pushes it to disk (or out), and the first ask after pays the reads.

Prints JSON on stdout (with the commit and the load average), progress on stderr. CPU timings on a shared
machine are noisy: compare ratios within one run.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from app.components import Components  # noqa: E402
from app.config import load_settings  # noqa: E402
from app.engine import prompt_cache  # noqa: E402
from app.engine.query import QueryParams  # noqa: E402
from app.engine.rag_engine import RagEngine  # noqa: E402
from common import git_commit  # noqa: E402

QUESTION = "Which harbour towns keep a lighthouse museum?"
WORDS = ("harbour tide lantern keeper museum ferry quay rope net gull stone wall market bread oven bell tower "
         "island reef current storm beacon chart compass salt pier dock mast sail anchor cargo fisher").split()


def log(message: str) -> None:
    print(f"[bench/leases] {message}", file=sys.stderr, flush=True)


def document(kind: str, i: int, words: int) -> tuple[str, str]:
    """A short made-up document, (title, text): one chunk, about `words` words."""
    rng = random.Random(f"{kind}-{i}")
    town = f"{kind.title()}port {i}"
    filler = " ".join(rng.choice(WORDS) for _ in range(words - 20))
    return town, (f"The harbour town of {town} keeps a lighthouse museum opened in {1800 + rng.randrange(200)}. "
                  f"Its keeper was {rng.choice(['Ada', 'Tomas', 'Mira', 'Ines'])} {rng.choice(['Wren', 'Brell'])}. "
                  f"Local notes: {filler}.")


def run_variant(leased: bool, args: argparse.Namespace, shared: Components | None) -> tuple[dict, Components]:
    with tempfile.TemporaryDirectory(prefix="ragblend-leases-") as tmp:
        def settings(memory_bytes: int):
            return load_settings(data_dir=tmp, model={"cache_dir": str(REPO / "data/models")},
                                 retrieval={"top_k": args.passages},
                                 store={"memory_bytes": memory_bytes, "memory_pinned_bytes": memory_bytes,
                                        "disk_bytes": 1 << 34, "disk_pinned_bytes": 1 << 34})

        probe = Components(settings(1 << 30))  # one passage's bytes in memory size the tier
        if shared is not None:
            probe.llm, probe.embedder = shared.llm, shared.embedder
        title, text = document("probe", 0, args.words)
        passage_bytes = probe.store.tiers[0].size_of(probe.kv_cache.ensure(probe.prompt.text_passage_ids(text, title)))
        memory_bytes = (args.passages + 1 + args.memory_slack) * passage_bytes  # the context, the head, slack
        probe.close()

        capped = settings(memory_bytes)
        parts = Components(capped)
        parts.llm, parts.embedder = probe.llm, probe.embedder
        engine = RagEngine(capped, parts)
        log(f"{'leased' if leased else 'unleased'}: ingesting {args.passages} documents "
            f"(memory tier {memory_bytes / 2**20:.1f} MiB, {passage_bytes / 2**20:.2f} MiB a passage)")
        for i in range(args.passages):
            parts.ingestor.ingest_text(f"context-{i}", *document("context", i, args.words))
        params = QueryParams(QUESTION, top_k=args.passages, max_tokens=1)

        first = engine.answer(params)
        lease = None
        if leased:
            keys = [u.key for u in first.kv_keys]  # as /v1/chat/completions with prompt_cache_retention 24h
            note = prompt_cache.lease(parts.store, "bench: leased context", [(keys, 86400.0)])
            lease = note.model_dump() | {"pinned_bytes": parts.store.lease_stats()["pinned_bytes"]}
        hits = [engine.answer(params) for _ in range(args.repeats)]

        log(f"hit TTFT {[r.stats.ttft_ms for r in hits]} ms; churning")
        churn = math.ceil(args.churn * memory_bytes / passage_bytes)
        for i in tqdm(range(churn), desc="churn (unleased documents' KV)", file=sys.stderr, leave=False):
            title, text = document("churn", i, args.words)
            parts.kv_cache.ensure(parts.prompt.text_passage_ids(text, title))
        after, *again = [engine.answer(params) for _ in range(args.repeats + 1)]
        memory = parts.store.stats()["tiers"]["memory"]
        parts.close()
    hit_ms = statistics.median(r.stats.ttft_ms for r in hits)
    report = {"passages": len(first.sources), "prompt_tokens": first.stats.prompt_tokens,
              "passage_bytes": passage_bytes, "memory_bytes": memory_bytes, "churn_entries": churn,
              "churn_bytes": churn * passage_bytes, "lease": lease,
              "first_ttft_ms": first.stats.ttft_ms, "hit_ttft_ms": hit_ms,
              "hit_ttft_ms_all": [r.stats.ttft_ms for r in hits], "hit_store_hits": hits[-1].stats.store_hits,
              "after_churn_ttft_ms": after.stats.ttft_ms, "after_churn_store_hits": after.stats.store_hits,
              "later_asks_ttft_ms": [r.stats.ttft_ms for r in again],  # memory hits either way (promoted)
              "ttft_after_over_hit": round(after.stats.ttft_ms / hit_ms, 3),
              "full_memory_hit_after_churn": after.stats.store_hits == {"memory": len(after.sources)},
              "memory_evictions": memory.get("evictions"), "memory_lease_held": memory.get("lease_held")}
    return report, probe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--passages", type=int, default=10, help="documents in the context (top_k)")
    parser.add_argument("--words", type=int, default=80, help="words a document")
    parser.add_argument("--churn", type=float, default=3.0, help="unleased KV stored, in memory tiers")
    parser.add_argument("--memory-slack", type=int, default=2, help="passages the memory tier holds beyond it")
    parser.add_argument("--repeats", type=int, default=3, help="asks for the first hit's TTFT (median)")
    args = parser.parse_args()
    load_before = os.getloadavg()
    results, shared = {}, None
    for name in ("leased", "unleased"):
        results[name], shared = run_variant(name == "leased", args, shared)
        log(f"{name}: after churn {results[name]['after_churn_store_hits']}, "
            f"TTFT {results[name]['after_churn_ttft_ms']} ms vs hit {results[name]['hit_ttft_ms']} ms")
    print(json.dumps({"passages": args.passages, "churn_of_memory": args.churn, "results": results,
                      "leased_within_10_percent": results["leased"]["ttft_after_over_hit"] <= 1.10,
                      "commit": git_commit(REPO), "loadavg_before": [round(x, 2) for x in load_before],
                      "loadavg_after": [round(x, 2) for x in os.getloadavg()]}, indent=2))


if __name__ == "__main__":
    main()
