"""Decode-step cost by batch size: what batching buys per token, and what limits it.

    python bench/decode.py [--context 2500] [--batches 1,2,4,8] [--steps 10] [--threads N]

Times `Blender.decode_step` for B rows, each over its own cache of about `--context` tokens (random
K/V: the cost does not depend on the values), with the model's linears as the Blender sets them on
the CPU (`SkinnyLinear`, blend.skinny) and as plain `nn.Linear`, interleaved in one run.
Prints JSON: per form and B, ms per step and per token, and the step's cost relative to B = 1.
The step reads every weight once (shared by the rows) and each row's own K/V (not shared), so
per-token cost falls with B only as far as the weights dominate.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from app.components import Components  # noqa: E402
from app.config import load_settings  # noqa: E402
from blend.cache import BlendCache  # noqa: E402
from blend.skinny import SkinnyLinear  # noqa: E402
from common import git_commit  # noqa: E402


def set_linears(model: nn.Module, cls: type[nn.Linear]) -> None:
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.__class__ = cls


def step_ms(blender, batch: int, context: int, steps: int) -> float:
    """Median ms of one decode step of `batch` rows (contexts context, context+37, ...)."""
    layers, heads, dim = blender.num_layers, blender.kv_heads, blender.head_dim
    lengths = [context + 37 * b for b in range(batch)]
    caches = [BlendCache(torch.randn(layers, heads, n + steps + 4, dim), torch.randn(layers, heads, n + steps + 4, dim),
                         length=n) for n in lengths]
    times = []
    for step in range(steps + 2):
        start = time.perf_counter()
        blender.decode_step(caches, [100] * batch, [n + step for n in lengths])
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[2:])  # the first two warm up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=2500)
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    components = Components(load_settings(model={"cache_dir": str(REPO / "data" / "models")}))
    blender = components.blender
    batches = [int(b) for b in args.batches.split(",")]
    forms = {"skinny": SkinnyLinear, "plain": nn.Linear}
    load_before = os.getloadavg()
    result = {form: {} for form in forms}
    for batch in batches:  # interleaved: both forms at each B
        for form, cls in forms.items():
            set_linears(blender.model, cls)
            ms = step_ms(blender, batch, args.context, args.steps)
            result[form][batch] = {"step_ms": round(ms, 1), "per_token_ms": round(ms / batch, 1)}
            print(f"[bench/decode] {form} B={batch}: {ms:.1f} ms/step", file=sys.stderr, flush=True)
    set_linears(blender.model, SkinnyLinear)
    for form in forms:
        one = result[form][batches[0]]["step_ms"]
        for row in result[form].values():
            row["step_vs_first"] = round(row["step_ms"] / one, 2)
    print(json.dumps({"context_tokens": args.context, "threads": torch.get_num_threads(), "forms": result,
                      "commit": git_commit(), "loadavg_before": [round(x, 2) for x in load_before],
                      "loadavg_after": [round(x, 2) for x in os.getloadavg()]}, indent=1))


if __name__ == "__main__":
    main()
