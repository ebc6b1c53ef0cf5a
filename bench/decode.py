"""Decode-step cost by batch size: what batching buys per token, and what limits it.

    python bench/decode.py [--context 2500] [--batches 1,2,4,8] [--steps 10] [--threads N]
    python bench/decode.py --device cuda [--context 4096] [--batches 1,8,32] [--steps 30]

CPU (the default): times `DecodeRuntime.step` for B rows of the embedded SmolLM2, each in its own KV pool
slot holding about `--context` tokens (random K/V: the cost does not depend on the values), in four forms
interleaved in one run: as the runtime runs it on the CPU (`kernel`: blend.kernel_step's loop over the C
kernels of blend.cpu_kernels), the model's own layers through the pool (`layers`, blend.batch.LayerStep: sdpa
attention, the kernels' linears; what a model the kernel step refuses runs), the same with `SkinnyLinear`'s MKL
form (`sdpa`: cpu_kernel off, blend.skinny), and with plain `nn.Linear` (`plain`). Prints JSON: per form and B,
ms per step and per token, and the step's cost relative to the first B. `--model tiny` runs a small random
Llama instead of SmolLM2 (a smoke run: no model files).

CUDA (`--device cuda`, for bench/device_check.sh): a randomly initialised Llama-3-8B-shaped model in
bfloat16 (config only, nothing downloaded), B rows of `--context` tokens: the step eager and as CUDA
graphs (`cuda_decode_timing`), the greedy tokens of both (they must be equal), and the model's own HF
forward at batch 1 over a DynamicCache of the same length, all timed with the device synchronised.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from blend.batch import LayerStep  # noqa: E402
from blend.decode import Decoding, SamplingParams  # noqa: E402
from blend.graphs import StepGraphs, cuda_graph_capture  # noqa: E402
from blend.pool import KVPool  # noqa: E402
from blend.skinny import SkinnyLinear  # noqa: E402
from common import git_commit  # noqa: E402

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
                 rope_theta=500000.0, rms_norm_eps=1e-5)
TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096)


def log(message: str) -> None:
    print(f"[bench/decode] {message}", file=sys.stderr, flush=True)


def set_linears(model: nn.Module, cls: type[nn.Linear], kernel: bool = False) -> None:
    """Every linear as `cls`; SkinnyLinear's few rows through the C kernel or not."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.__class__ = cls
            if cls is SkinnyLinear:
                module.kernel = kernel and module.weight.dtype == torch.float32 and module.weight.is_contiguous()


def fill_rows(runtime, batch: int, context: int, seed: int = 0) -> list[Decoding]:
    """`batch` pool slots holding random K/V for `context` + 37·b tokens (the same for the same seed)."""
    pool, rows = runtime.pool, []
    layers, _, heads, _, dim = pool.keys.shape
    generator = torch.Generator(device=pool.keys.device).manual_seed(seed)
    for b in range(batch):
        slot, length = pool.acquire(), context + 37 * b
        shape = (1, heads, length, dim)  # a layer's K or V, as a prefill's cache lands
        pool.load(slot, [tuple(torch.randn(shape, generator=generator, dtype=pool.keys.dtype, device=pool.keys.device)
                               for _ in range(2)) for _ in range(layers)])
        rows.append(Decoding(pool, slot, length, SamplingParams()))
    return rows


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(runtime, rows: list[Decoding], steps: int, warmup: int = 2) -> tuple[float, list[list[int]]]:
    """Median ms of a greedy decode step over `rows` (each step feeds the previous step's tokens), and the
    tokens of each step."""
    tokens, times, seen = [100] * len(rows), [], []
    for _ in range(warmup + steps):
        synchronize(runtime.device)
        start = time.perf_counter()
        tokens = runtime.step(rows, tokens, [r.length for r in rows])  # ids on the host: synchronised
        times.append(time.perf_counter() - start)
        seen.append(tokens)
    return 1000 * statistics.median(times[warmup:]), seen


def release(rows: list[Decoding]) -> None:
    for row in rows:
        row.release()


def cpu_runtimes(args, batches: list[int]) -> dict:
    """The decode runtime with the CPU kernels (auto) and without (off), over SmolLM2 or a tiny random Llama."""
    from blend import Blender, DecodeRuntime

    max_len = args.context + 37 * max(batches) + args.steps + 8
    if args.model == "tiny":
        model = random_llama(torch.device("cpu"), TINY)
    else:
        from blend.model import load_model
        loaded = load_model("embedded", cache_dir=REPO / "data" / "models")
        model = loaded.model
    runtimes = {}
    for kernel in ("auto", "off"):  # each prepares the model's linears for itself: `off` last
        blender = Blender(model, tokenizer=None, fingerprint="bench", cpu_kernel=kernel)
        runtimes[kernel] = DecodeRuntime(blender, slots=max(batches), max_len=max_len)
    return runtimes


def cpu_timing(args) -> dict:
    from blend import cpu_kernels

    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    runtimes = cpu_runtimes(args, batches)
    auto = runtimes["auto"]
    # the step as the runtime runs it on the CPU (kernel), the model's layers over the kernels' linears, with
    # MKL's instead, and with plain nn.Linear too: (runtime, linears, the kernels' linears, kernel step)
    forms = {"kernel": ("auto", SkinnyLinear, True, True), "layers": ("auto", SkinnyLinear, True, False),
             "sdpa": ("off", SkinnyLinear, False, False), "plain": ("off", nn.Linear, False, False)}
    result = {form: {} for form in forms}
    kernel_step = auto.form if not auto.kernel_step_refusal else None
    layers = LayerStep(auto.model)
    pools = {}  # (runtime setting, pool dtype) → a pool of the runtime's shape: each form over its own elements
    for batch in batches:  # interleaved: every form at each B
        for form, (setting, linear, kernel_linears, use_kernel_step) in forms.items():
            if use_kernel_step and kernel_step is None:
                continue
            runtime = runtimes[setting]
            set_linears(runtime.model, linear, kernel_linears)
            runtime.form = kernel_step if use_kernel_step else layers
            dtype = runtime.form.pool_dtype or runtime.model.dtype
            if (setting, dtype) not in pools:
                shape = runtime.pool.keys.shape
                pools[setting, dtype] = KVPool(shape[0], shape[2], shape[4], slots=shape[1],
                                               max_len=runtime.pool.max_len, dtype=dtype, device=runtime.device)
            runtime.pool = pools[setting, dtype]
            rows = fill_rows(runtime, batch, args.context)
            ms, _ = timed_steps(runtime, rows, args.steps)
            release(rows)
            result[form][batch] = {"step_ms": round(ms, 1), "per_token_ms": round(ms / batch, 1)}
            log(f"{form} B={batch}: {ms:.1f} ms/step")
    for form in forms:
        if result[form]:
            one = result[form][batches[0]]["step_ms"]
            for row in result[form].values():
                row["step_vs_first"] = round(row["step_ms"] / one, 2)
    return {"device": "cpu", "model": args.model, "context_tokens": args.context, "threads": torch.get_num_threads(),
            "cpu_kernels": auto.backend.kernels, "cpu_kernels_unavailable": cpu_kernels.unavailable(),
            "kernel_step_refusal": auto.kernel_step_refusal, "forms": result}


def random_llama(device: torch.device, shape: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if device.type == "cuda" else torch.float32)
    try:
        with device:
            return LlamaForCausalLM(LlamaConfig(**shape)).eval()
    finally:
        torch.set_default_dtype(default)


@torch.inference_mode()
def own_forward_ms(model, context: int, steps: int, warmup: int = 2) -> float:
    """The model's own HF forward at batch 1 over a DynamicCache of `context` random positions."""
    from transformers import DynamicCache

    config, device = model.config, model.device
    head_dim = config.hidden_size // config.num_attention_heads
    cache = DynamicCache()
    for layer in range(config.num_hidden_layers):
        kv = torch.randn(2, 1, config.num_key_value_heads, context, head_dim, device=device, dtype=model.dtype)
        cache.update(kv[0], kv[1], layer)
    token, times = torch.tensor([[100]], device=device), []
    for step in range(warmup + steps):
        synchronize(device)
        start = time.perf_counter()
        out = model(input_ids=token, position_ids=torch.tensor([[context + step]], device=device), cache=cache,
                    use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[warmup:])


def cuda_decode_timing(device: str = "cuda", context: int = 4096, batches: tuple[int, ...] = (1, 8, 32),
                       steps: int = 30, shape: dict | None = None, progress=None) -> dict:
    """The decode step on a GPU, eager and as CUDA graphs, at each batch size over `context`-token rows (the
    8B Llama shape by default, random bfloat16 weights): ms per step, tokens/s, whether both gave the same
    greedy tokens; and the model's own forward at batch 1. `progress(result)` after each part, so a killed run
    keeps what it measured; a part that fails records its error and the rest go on. (On the CPU it runs too,
    with a small `shape`: graph capture then fails and falls back, which is reported.)"""
    from blend import Blender, DecodeRuntime

    progress = progress or (lambda result: None)
    device = torch.device(device)
    log(f"building a random {'Llama-3-8B' if shape is None else 'custom'}-shaped model on {device}")
    model = random_llama(device, shape or LLAMA3_8B)
    blender = Blender(model, tokenizer=None, fingerprint="random-llama")
    # (a model the gate refused decodes through the pool all the same: the step does not depend on the prefill)
    runtime = DecodeRuntime(blender, slots=max(batches), max_len=context + 37 * max(batches) + steps + 8,
                            cuda_graphs="on")
    result: dict = {"device": str(device), "context_tokens": context, "batches": {},
                    "dtype": str(blender.dtype).removeprefix("torch."), "blend_refused": blender.unsupported,
                    "step_form": type(runtime.form).__name__}
    result["own_forward_b1_ms"] = _attempt(lambda: round(own_forward_ms(model, context, steps), 2))
    log(f"own forward, batch 1: {result['own_forward_b1_ms']} ms/step")
    progress(result)
    for batch in batches:
        row: dict = {}
        tokens = {}
        for mode in ("eager", "graphs"):  # (on the CPU no graph can be captured: that tries the fallback)
            capture = cuda_graph_capture if device.type == "cuda" else _no_capture
            runtime.graphs = StepGraphs(enabled=mode == "graphs", capture=capture)
            rows = []
            try:
                rows = fill_rows(runtime, batch, context)  # the same K/V in both modes
                ms, tokens[mode] = timed_steps(runtime, rows, steps)
                row[mode] = {"step_ms": round(ms, 2), "tokens_per_s": round(1000 * batch / ms, 1)}
            except Exception as exc:  # noqa: BLE001 - recorded; the other parts still run
                row[mode] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-1500:]}
            finally:
                release(rows)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            log(f"{mode} B={batch}: {row[mode]}")
        row["graphs_captured"] = len(runtime.graphs.captured)
        row["graphs_fallback"] = runtime.graphs.disabled
        row["same_tokens"] = tokens.get("eager") is not None and tokens.get("eager") == tokens.get("graphs")
        result["batches"][batch] = row
        progress(result)
    return result


def _attempt(measure):
    try:
        return measure()
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"


def _no_capture(fn):
    raise RuntimeError("CUDA graphs need a CUDA device")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--context", type=int, default=None, help="tokens per row (default: 2500 CPU, 4096 CUDA)")
    parser.add_argument("--batches", default=None, help="default: 1,2,4,8 CPU, 1,8,32 CUDA")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default: 10 CPU, 30 CUDA)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"], help="CPU: the model timed")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here (CUDA: after each part)")
    args = parser.parse_args()
    load_before = os.getloadavg()

    def report(result: dict) -> str:
        text = json.dumps({**result, "commit": git_commit(), "loadavg_before": [round(x, 2) for x in load_before],
                           "loadavg_after": [round(x, 2) for x in os.getloadavg()]}, indent=1)
        if args.out:
            args.out.write_text(text)
        return text

    if args.device == "cuda":
        result = cuda_decode_timing(context=args.context or 4096,
                                    batches=tuple(int(b) for b in (args.batches or "1,8,32").split(",")),
                                    steps=args.steps or 30, progress=report)
    else:
        args.context, args.batches, args.steps = args.context or 2500, args.batches or "1,2,4,8", args.steps or 10
        result = cpu_timing(args)
    print(report(result))


if __name__ == "__main__":
    main()
