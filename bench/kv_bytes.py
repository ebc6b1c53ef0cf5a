"""Bytes per token of each store codec on the real model's KV, and the error each codec leaves: the
measurement that chooses the cachegen bins (quality is `ragblend compare --codec NAME`'s).

    python bench/kv_bytes.py [--start 30 --limit 30 --passages 5] [--fit corpus|musique] [--plans FILE]

The test chunks are the first `--passages` passages of MuSiQue dev questions start..start+limit, each
precomputed after the prompt head as ingest does (../shared/data/musique_dev.json, read in place). The
cachegen tables are fitted on `--fit`: the repository's demo corpus (corpus/, one passage a file) or the
passages of the next `--limit` MuSiQue questions (never the test ones). Per codec: bytes/token (the
entry's payload: token ids, scales, symbols; headers excluded), bits a value (the same without the ids),
the ratio to fp16 and int8, and the relative RMS error of the decoded keys and values. Deterministic:
no timing. Prints JSON on stdout, progress on stderr.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.components import Components  # noqa: E402
from app.config import load_settings  # noqa: E402
from common.chunk_kv import ChunkKV  # noqa: E402
from store import CODECS, CacheGenTables, decode, encode, register_tables  # noqa: E402
from store.codecs import DEFAULT_BINS, BinPlan  # noqa: E402
from store.serialize import parse_head  # noqa: E402
from tests.helpers import MODEL_CACHE, ROOT, load_musique  # noqa: E402

PLANS = {  # name: {"keys": [[first layer, bins], ...], "values": [...]}
    "default": DEFAULT_BINS.as_dict(),
    "k16v16": {"keys": [[0, 16]], "values": [[0, 16]]},
    "k32-16@10_v16-8@10": {"keys": [[0, 32], [10, 16]], "values": [[0, 16], [10, 8]]},
    "k16-8@10_v16-8@10": {"keys": [[0, 16], [10, 8]], "values": [[0, 16], [10, 8]]},
    "k16_v8": {"keys": [[0, 16]], "values": [[0, 8]]},
    "k32-16@10_v8": {"keys": [[0, 32], [10, 16]], "values": [[0, 8]]},
}


def log(msg: str) -> None:
    print(f"[bench/kv_bytes] {msg}", file=sys.stderr, flush=True)


def payload_bytes(data: bytes) -> int:
    """An entry's bytes after its header: token ids and layer sections."""
    head = parse_head(data)
    return len(data) - head.payload_start


def chunk_kvs(parts: Components, passages: list[dict]) -> list[ChunkKV]:
    """Each passage's KV computed after the prompt head, as ingest stores it."""
    head_ids = parts.prompt.head_ids
    head_kv = parts.blender.precompute(head_ids)
    kvs = []
    for i, p in enumerate(passages):
        ids = parts.prompt.text_passage_ids(p["text"], p.get("title") or None)
        kvs.append(parts.blender.precompute(ids, head_ids, context=head_kv))
        if (i + 1) % 10 == 0:
            log(f"precomputed {i + 1}/{len(passages)} chunks")
    return kvs


def corpus_passages() -> list[dict]:
    files = sorted(p for p in (ROOT / "corpus").rglob("*") if p.suffix in (".md", ".txt"))
    return [{"title": f.stem, "text": f.read_text()} for f in files]


def errors(kvs: list[ChunkKV], got: list[ChunkKV]) -> dict[str, float]:
    """Relative RMS error of keys and values over every chunk: ||x - decoded|| / ||x||."""
    out = {}
    for part in ("keys", "values"):
        num = sum(float((getattr(a, part) - getattr(b, part)).float().square().sum()) for a, b in zip(kvs, got))
        den = sum(float(getattr(a, part).float().square().sum()) for a in kvs)
        out[f"rel_rms_{part}"] = round((num / den) ** 0.5, 4)
    return out


def measure(codec, kvs: list[ChunkKV]) -> dict:
    tokens = sum(kv.num_tokens for kv in kvs)
    values = sum(2 * kv.keys.numel() for kv in kvs)
    datas = [encode(kv, codec) for kv in kvs]
    payload = sum(payload_bytes(d) for d in datas)
    return {"bytes_per_token": round(payload / tokens, 1),
            "bits_per_value": round((payload - 8 * tokens) * 8 / values, 3),
            **errors(kvs, [decode(d) for d in datas])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--start", type=int, default=30)
    parser.add_argument("--limit", type=int, default=30)
    parser.add_argument("--passages", type=int, default=5)
    parser.add_argument("--fit", choices=("corpus", "musique"), default="corpus")
    parser.add_argument("--plans", type=Path, help="JSON {name: {keys, values}} of bin plans (default: a built-in set)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    plans = json.loads(args.plans.read_text()) if args.plans else PLANS
    settings = load_settings(model={"cache_dir": str(MODEL_CACHE)})
    parts = Components(settings)
    items = load_musique(args.start + 2 * args.limit)
    test = [c for q in items[args.start:args.start + args.limit] for c in q["ctxs"][:args.passages]]
    fit = corpus_passages() if args.fit == "corpus" else \
        [c for q in items[args.start + args.limit:] for c in q["ctxs"][:args.passages]]
    log(f"{len(test)} test chunks, {len(fit)} fit chunks ({args.fit})")
    test_kvs, fit_kvs = chunk_kvs(parts, test), chunk_kvs(parts, fit)
    results = {name: measure(name, test_kvs) for name in CODECS}
    log("fixed codecs done")
    for name, plan in plans.items():
        tables = CacheGenTables.fit(fit_kvs, BinPlan.of(plan))
        results[f"cachegen:{name}"] = {"plan": plan, **measure(register_tables(tables), test_kvs)}
        log(f"cachegen {name}: {results[f'cachegen:{name}']}")
    fp16, int8 = results["fp16"]["bytes_per_token"], results["int8"]["bytes_per_token"]
    for r in results.values():
        r["x_fp16"], r["int8_over"] = round(r["bytes_per_token"] / fp16, 4), round(int8 / r["bytes_per_token"], 3)
    shape = list(test_kvs[0].keys.shape)
    print(json.dumps({"model": parts.llm.name, "shape_lhd": [shape[0], shape[1], shape[3]],
                      "test_tokens": sum(kv.num_tokens for kv in test_kvs),
                      "fit": args.fit, "fit_tokens": sum(kv.num_tokens for kv in fit_kvs), "codecs": results},
                     indent=1))


if __name__ == "__main__":
    main()
