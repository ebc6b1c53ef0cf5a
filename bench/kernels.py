"""The CPU kernels as torch ops (blend.cpu_kernels) against the ctypes library they replaced, on the same inputs.

    python bench/kernels.py [--rounds 7] [--layers 30] [--keys 2500] [--prefill-keys 3100] [--queries 405]
                            [--threads N] [--old REV | --no-old]

SmolLM2-135M's shapes (9 query heads, 3 KV heads of 64, hidden 576, MLP 1,536, vocabulary 49,152), random values:
- `decode_attention`: 4 rows of about `--keys` keys each, one pool per layer, over `--layers` layers;
- `linear_rows`: 1, 4 and 8 rows through every linear of `--layers` layers and the LM head;
- `rope_write`: 4 rows into each layer's pool (a call with little work: what a call costs);
- `prefill_attention`: `--queries` queries at scattered positions over `--prefill-keys` keys, one layer;
- `prefill_linears`: one layer's seven linears at 3.1k and 470 rows (a full and a blended prefill's) as
  SkinnyLinear runs them now (F.linear, MKL) and as it did before (oneDNN, through the old blend/skinny.py).
"Before" is the old blend/cpu_kernels.py (ctypes, kernels/cpu_kernels.c) and blend/skinny.py at `--old` (by
default the commit before the C source went), imported from git into a temporary directory; the forms alternate
in each of `--rounds` rounds and the medians of wall and process CPU time (and the least wall time) are
reported, with the load average before and after (other processes share the cores). Each kernel's outputs
before and after are compared bit for bit. Prints JSON.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from blend import cpu_kernels, skinny  # noqa: E402
from common import git_commit  # noqa: E402

HEADS, KV_HEADS, DIM, HIDDEN, MLP, VOCAB = 9, 3, 64, 576, 1536, 49152
OLD_SOURCE = "blend/kernels/cpu_kernels.c"


def old_revision() -> str | None:
    """The commit before the one that removed the C source (None: not in this checkout's history)."""
    def git(*arguments: str) -> str:
        return subprocess.run(["git", *arguments], cwd=REPO, capture_output=True, text=True).stdout.strip()

    try:
        removed = git("rev-list", "-1", "HEAD", "--", OLD_SOURCE)
        return (git("rev-parse", "--short", f"{removed}^") or None) if removed else None
    except OSError:  # no git
        return None


def import_old(revision: str, directory: Path) -> tuple:
    """The old blend.cpu_kernels and blend.skinny from `revision`, as modules of their own."""
    def show(path: str) -> str:
        return subprocess.run(["git", "show", f"{revision}:{path}"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout

    (directory / "kernels").mkdir()
    (directory / "kernels" / "cpu_kernels.c").write_text(show(OLD_SOURCE))
    modules = []
    for name in ("cpu_kernels", "skinny"):
        (directory / f"{name}.py").write_text(show(f"blend/{name}.py"))
        spec = importlib.util.spec_from_file_location(f"old_{name}", directory / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        modules.append(module)
    return tuple(modules)


def decode_inputs(layers: int, keys: int, generator: torch.Generator) -> list[tuple]:
    lengths = torch.tensor([keys, keys - 50, keys + 20, keys - 20])
    columns = int(lengths.max()) + 64
    out = []
    for _ in range(layers):
        pool_k, pool_v = (torch.randn(4, KV_HEADS, columns, DIM, generator=generator) for _ in range(2))
        query = torch.randn(4, KV_HEADS, HEADS // KV_HEADS, DIM, generator=generator)
        out.append((query, pool_k, pool_v, lengths))
    return out


def layer_linears(generator: torch.Generator) -> list[torch.Tensor]:
    """One decoder layer's weights [out, in]: q, k, v, o, gate, up, down."""
    shapes = [(HEADS * DIM, HIDDEN), (KV_HEADS * DIM, HIDDEN), (KV_HEADS * DIM, HIDDEN), (HIDDEN, HEADS * DIM),
              (MLP, HIDDEN), (MLP, HIDDEN), (HIDDEN, MLP)]
    return [torch.randn(*shape, generator=generator) * 0.02 for shape in shapes]


def rope_inputs(layers: int, generator: torch.Generator) -> list[tuple]:
    out = []
    for _ in range(layers):
        qkv = torch.randn(4, (HEADS + 2 * KV_HEADS) * DIM, generator=generator)
        angles = torch.rand(4, DIM // 2, generator=generator)
        cos, sin = torch.cat([angles, angles], 1).cos(), torch.cat([angles, angles], 1).sin()
        pools = [torch.zeros(4, KV_HEADS, 256, DIM) for _ in range(2)]
        out.append((*qkv.split([HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], 1), cos, sin,
                    torch.tensor([5, 100, 200, 255]), *pools))
    return out


def prefill_inputs(queries: int, keys: int, generator: torch.Generator) -> tuple:
    suffix = 20  # the question's tokens at the end, the rest scattered over the prompt
    scattered = torch.randperm(keys - suffix, generator=generator)[: queries - suffix].sort().values
    positions = torch.cat([scattered, torch.arange(keys - suffix, keys)])
    query = torch.randn(1, queries, HEADS, DIM, generator=generator).transpose(1, 2)  # as a layer makes it
    return (query, torch.randn(1, KV_HEADS, keys, DIM, generator=generator),
            torch.randn(1, KV_HEADS, keys, DIM, generator=generator), positions)


def kernel_cases(module, layers: int, keys: int, prefill_keys: int, queries: int) -> dict[str, Callable]:
    """Each case: a callable over fixed inputs (the same for both modules) returning its outputs."""
    generator = torch.Generator().manual_seed(0)
    decode = decode_inputs(layers, keys, generator)
    weights = [w for _ in range(layers) for w in layer_linears(generator)]
    weights.append(torch.randn(VOCAB, HIDDEN, generator=generator) * 0.02)  # the LM head
    rows = {count: torch.randn(count, HIDDEN, generator=generator) for count in (1, 4, 8)}
    wide = {count: torch.randn(count, MLP, generator=generator) for count in (1, 4, 8)}
    rope = rope_inputs(layers, generator)
    prefill = prefill_inputs(queries, prefill_keys, generator)

    def linears(count: int) -> list[torch.Tensor]:
        return [module.linear_rows(wide[count] if w.shape[1] == MLP else rows[count], w) for w in weights]

    cases = {"decode_attention": lambda: [module.decode_attention(*args) for args in decode]}
    for count in (1, 4, 8):
        cases[f"linear_rows_{count}"] = lambda count=count: linears(count)
    cases["rope_write"] = lambda: [module.rope_write(*args) for args in rope] + [p for args in rope for p in args[-2:]]
    cases["prefill_attention"] = lambda: [module.prefill_attention(*prefill)]
    return cases


def linear_cases(skinny_module) -> dict[str, Callable]:
    """One layer's seven linears as SkinnyLinear modules of `skinny_module` (oneDNN on where it has it)."""
    generator = torch.Generator().manual_seed(1)
    layer = nn.ModuleList()
    for weight in layer_linears(generator):
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        linear.weight.data = weight
        layer.append(linear)
    if hasattr(skinny_module.SkinnyLinear, "onednn"):  # the old module's many-row oneDNN form
        skinny_module.use_skinny_linears(layer, onednn=True)
    else:
        skinny_module.use_skinny_linears(layer)
    cases = {}
    for count in (3100, 470):
        inputs = {features: torch.randn(count, features, generator=generator) for features in (HIDDEN, MLP)}
        cases[f"prefill_linears_{count}"] = lambda inputs=inputs: [m(inputs[m.in_features]) for m in layer]
    return cases


def timed(case: Callable) -> tuple[float, float]:
    """Wall and process CPU milliseconds of one call (the CPU time is the steadier when other processes load
    the cores: it leaves out the time spent waiting for one)."""
    wall, cpu = time.perf_counter(), time.process_time()
    case()
    return (time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--keys", type=int, default=2500)
    parser.add_argument("--prefill-keys", type=int, default=3100)
    parser.add_argument("--queries", type=int, default=405)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--old", default=None, help="the git revision to compare with (default: before the C++)")
    parser.add_argument("--no-old", action="store_true", help="time the ops alone")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if cpu_kernels.load() is None:
        sys.exit(f"no CPU kernels: {cpu_kernels.unavailable()}")
    revision = None if args.no_old else args.old or old_revision()
    sizes = (args.layers, args.keys, args.prefill_keys, args.queries)
    forms = {"new": {**kernel_cases(cpu_kernels, *sizes), **linear_cases(skinny)}}
    with tempfile.TemporaryDirectory() as directory:
        if revision:
            old_kernels, old_skinny = import_old(revision, Path(directory))
            if old_kernels.load() is None:
                sys.exit(f"the old kernels did not build: {old_kernels.unavailable()}")
            forms["old"] = {**kernel_cases(old_kernels, *sizes), **linear_cases(old_skinny)}
        same_bits = {}
        if "old" in forms:
            for name, case in forms["new"].items():
                if not name.startswith("prefill_linears"):  # oneDNN and MKL sum in different orders
                    same_bits[name] = all(torch.equal(a, b) for a, b in zip(case(), forms["old"][name]()))
        load_before = os.getloadavg()
        times = {form: {name: [] for name in cases} for form, cases in forms.items()}
        for _ in range(args.rounds):
            for name in forms["new"]:
                for form, cases in forms.items():  # the forms alternate, case by case
                    times[form][name].append(timed(cases[name]))
        load_after = os.getloadavg()
    medians, cpu_medians = ({form: {name: round(statistics.median(t[clock] for t in runs), 2)
                                    for name, runs in cases.items()} for form, cases in times.items()}
                            for clock in (0, 1))
    report = {
        "commit": git_commit(), "old": revision, "threads": torch.get_num_threads(), "rounds": args.rounds,
        "layers": args.layers, "keys": args.keys, "prefill_keys": args.prefill_keys, "queries": args.queries,
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
        "median_ms": medians, "median_cpu_ms": cpu_medians, "same_bits": same_bits,
        "min_ms": {form: {name: round(min(t[0] for t in runs), 2) for name, runs in cases.items()}
                   for form, cases in times.items()},  # the least disturbed call
    }
    if "old" in medians:
        for key, clock in (("new_over_old", medians), ("new_over_old_cpu", cpu_medians)):
            report[key] = {name: round(clock["new"][name] / clock["old"][name], 3) for name in clock["new"]}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
