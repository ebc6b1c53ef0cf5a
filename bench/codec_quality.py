"""KL and top-1 against full prefill per store codec, at reuse and blend@R: `ragblend compare --codec`'s
measure with one full prefill per question shared by every codec (a compare run per codec repeats it).

    python bench/codec_quality.py [--codecs native,fp16,int8,int4,int2,cachegen] [--plans FILE]
                                  [--start 30 --limit 30 --passages 5 --ratio 0.15] [--out FILE]

Per question, as app.cli.compare does it: the prompt head | first K passages | question (each passage's KV
precomputed after the head, exact), full prefill's greedy answer as the reference, then for every codec the
passages' KV through that codec and back (the head stays exact, as serving keeps it) and a blended prefill
at reuse (ratio 0) and at --ratio with the default selection; KL(full || mode) and top-1 agreement
teacher-forced over the reference (app.cli.compare.agreement). Deterministic: no timing.

Codecs: the store's by name ("cachegen" with store.cachegen_bins: its quantiser; the entropy coding is
lossless), a cachegen bin plan by its name in --plans (a JSON object, name -> {"keys": [[first layer, bins],
...], "values": [...]}, as bench/kv_bytes.py takes), and "int2": KIVI at 2 bits (store.codecs.Int4Codec's
quantiser with 3 levels), which the store does not offer (its KL is why). Prints JSON on stdout (means per
codec and mode, and per question), progress on stderr; --out is rewritten after each question.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from app.cli.compare import CompareConfig, Harness, Mode, PromptKV, agreement, load_dataset  # noqa: E402
from app.components import Components  # noqa: E402
from app.config import load_settings  # noqa: E402
from common import git_commit, write_atomic  # noqa: E402
from store import CODECS, get_codec  # noqa: E402
from store.codecs import BinPlan, Codec, Int4Codec  # noqa: E402


class Int2Codec(Int4Codec):
    """KIVI at 2 bits: Int4Codec's grouping and outward-rounded scales, 3 levels, four values a byte."""

    name, bits = "int2", 2
    levels, per_byte = (1 << bits) - 1, 8 // bits


def codecs_named(names: list[str], plans: dict, default_bins: dict) -> dict[str, Codec]:
    codecs = {}
    for name in names:
        if name in plans:
            codecs[name] = get_codec("cachegen", bins=BinPlan.of(plans[name]))
        elif name == "cachegen":
            codecs[name] = get_codec("cachegen", bins=default_bins)
        elif name == "int2":
            codecs[name] = Int2Codec()
        elif name in CODECS:
            codecs[name] = get_codec(name)
        else:
            raise SystemExit(f"unknown codec {name!r}: one of {[*CODECS, 'cachegen', 'int2', *plans]}")
    return codecs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", type=Path, default=REPO.parent / "shared/data/musique_dev.json")
    parser.add_argument("--codecs", default="native,fp16,int8,int4,int2,cachegen")
    parser.add_argument("--plans", type=Path, default=None, help="JSON: cachegen bin plans by name")
    parser.add_argument("--start", type=int, default=30)
    parser.add_argument("--limit", type=int, default=30)
    parser.add_argument("--passages", type=int, default=5)
    parser.add_argument("--ratio", type=float, default=0.15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="rewritten with the results after each question")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    settings = load_settings(model={"cache_dir": str(REPO / "data/models")})
    plans = json.loads(args.plans.read_text()) if args.plans else {}
    codecs = codecs_named(args.codecs.split(","), plans, settings.store.cachegen_bins.plan())
    items = load_dataset(args.dataset, args.start + args.limit)[args.start:]
    commit = git_commit()  # the code measured: the checkout as the run starts

    parts = Components(settings)
    blender = parts.blender
    selection = settings.blend.selection
    config = CompareConfig(str(args.dataset), args.passages, [0.0, args.ratio], settings.blend.precompute, "none",
                           settings.blend.check_layer, settings.blend.deviation, [selection], 32, 0, args.threads)
    harness = Harness(blender, parts.runtime, parts.prompt, config)
    modes = [Mode("reuse", 0.0), Mode(f"{selection}@{args.ratio:g}", args.ratio, selection)]
    questions = []
    for n, item in enumerate(items):
        index, exact = args.start + n, harness.prepare(item)
        full = harness.timed(Mode("full", None), exact, seed=index)
        ref, _ = harness.answer(full.prefill)
        ref_logp = torch.log_softmax(blender.teacher_force(full.prefill, ref), dim=-1)  # [A, V]
        row = {"index": index, "prompt_tokens": len(exact.full_ids), "reference_tokens": len(ref), "codecs": {}}
        for name, codec in codecs.items():
            coded = PromptKV([exact.segments[0], *map(codec.round_trip, exact.segments[1:])], exact.suffix_ids,
                             exact.full_ids)
            row["codecs"][name] = {}
            for mode in modes:
                logp = torch.log_softmax(blender.teacher_force(harness.timed(mode, coded, index).prefill, ref), -1)
                kl, top1 = agreement(ref_logp, logp)
                row["codecs"][name][mode.name] = {"kl": round(kl, 5), "top1": round(top1, 4)}
        questions.append(row)
        report = summary(questions, codecs, modes, args, settings) | {"commit": commit}
        if args.out:
            write_atomic(args.out, json.dumps(report, indent=1).encode())
        print(f"[codec_quality] question {index} ({n + 1}/{len(items)}): "
              + ", ".join(f"{c} {row['codecs'][c][modes[1].name]['kl']:.3f}" for c in codecs), file=sys.stderr,
              flush=True)
    parts.close()
    print(json.dumps(report, indent=1))


def summary(questions: list[dict], codecs: dict[str, Codec], modes: list[Mode], args, settings) -> dict:
    means = {name: {mode.name: {metric: round(statistics.fmean(q["codecs"][name][mode.name][metric]
                                                               for q in questions), 4)
                                for metric in ("kl", "top1")} for mode in modes} for name in codecs}
    return {"dataset": str(args.dataset), "questions": f"{args.start}..{args.start + len(questions) - 1}",
            "n": len(questions), "passages": args.passages, "selection": settings.blend.selection,
            "plans": {name: c.plan.as_dict() for name, c in codecs.items() if hasattr(c, "plan")},
            "means": means, "per_question": questions}


if __name__ == "__main__":
    main()
