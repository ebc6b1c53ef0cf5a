"""What a GPU user compares (issue #25), in one run: a randomly initialised Llama-3-8B-shaped model in
bfloat16 (random weights time like real ones; no model hub needed), prompts of --chunk-token chunks after
a 32-token head and before a 32-token question.

  baseline   HF's own sdpa forward of the same prompt (and the project's full_prefill), and the full prefill
             through the blend loop's own attention (the backend's plan: every token through every layer), so
             what blending buys is told apart from what the attention kernel buys
  cases      reuse, blend@0.15 / 0.3 (query, hkvd) with the KV resident on the GPU; reuse / blend@0.15 with
             the KV from the memory tier and the disk tier, pipelined and whole (where `store` imports)
  phases     each case's PrefillStats.timings_ms (each phase waits for the device: Backend.synchronize)
  exactness  float32 and bfloat16: HF one vs two pieces, eager vs sdpa, full_prefill vs HF, blend@1 vs HF
             (max |Δlogit|, KL, top-1 equal); the start-up gate's verdict in each dtype
  decode     DecodeRuntime.step at batch 1, 8, 32 (graphed, as served), the same rows under a token mask (the
             grammar-constrained step: masked rows beside a free one), and the model's own forward at batch 1
  codecs     every store codec (issue #42): random KV of the 8B shape encoded on the host and stored on disk, read
             back as a pipelined loader reads it (host part on the read threads, dequantised on the device in the
             model's dtype), every layer checked against the codec's stated bound; decode MB/s (`--only codecs`)

Medians of --repeats, synchronised. JSON lands in --out (device_check.json, rewritten after every
case: a killed run keeps what it measured); a short table is printed last. Needs only torch,
transformers and this repository's blend/common (store for the tier cases). CPU smoke test:
`--tiny --device cpu`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from blend import BLEND_ATTENTION, Blender, DecodeRuntime, SamplingParams  # noqa: E402
from common import git_commit  # noqa: E402
from common.placement import Placement  # noqa: E402

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=65536,
                 rope_theta=500000.0, rms_norm_eps=1e-5)
TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=8192)
HEAD, QUESTION = 32, 32


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Report:
    def __init__(self, out: Path):
        self.path, self.data = out / "device_check.json", {}
        out.mkdir(parents=True, exist_ok=True)

    def dump(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=1))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(device: torch.device, tiny: bool, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            config = LlamaConfig(**(TINY if tiny else LLAMA3_8B))
            config._attn_implementation = "sdpa"
            return LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)


def timed(fn, device: torch.device, repeats: int):
    fn()  # warm-up (and, on CUDA, compiles)
    times, out = [], None
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


@contextmanager
def recorded(part: dict, name: str, label: str, device: torch.device, report: Report) -> Iterator[None]:
    """One case of a part: an exception is recorded under `name` and logged (the check goes on); after it, the
    device's cache is emptied and the report written, so a crash later leaves what ran."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - recorded; the check goes on
        part[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-1200:]}
        log(f"  {label}: ERROR {exc}")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    report.dump()


def prompt(vocab: int, tokens: int, chunk: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(10, vocab, (n,), generator=g).tolist()  # noqa: E731
    head, question = ids(HEAD), ids(QUESTION)
    return head, [ids(chunk) for _ in range(max(1, (tokens - HEAD - QUESTION) // chunk))], question


def hf_forward(model, ids: list[int], device, implementation: str = "sdpa") -> torch.Tensor:
    """The model's own forward in `implementation`: last logits [V] (float32, host)."""
    own = model.config._attn_implementation
    model.set_attn_implementation(implementation)
    try:
        with torch.inference_mode():
            return model(input_ids=torch.tensor([ids], device=device), logits_to_keep=1).logits[0, -1].float().cpu()
    finally:
        model.set_attn_implementation(own)


def compare(reference: torch.Tensor, x: torch.Tensor) -> dict:
    kl = torch.nn.functional.kl_div(x.log_softmax(-1), reference.log_softmax(-1), log_target=True, reduction="sum")
    return {"max_abs": float((x - reference).abs().max()), "kl": float(kl),
            "top1": bool(x.argmax() == reference.argmax())}


def exactness(blender: Blender, device, tokens: int, chunk: int) -> dict:
    """One prompt's last logits computed several ways: the dtype's own spread next to the blend loop's error."""
    from transformers import DynamicCache
    model = blender.model
    head, chunks, question = prompt(model.config.vocab_size, tokens, chunk, seed=123)
    ids = head + sum(chunks, []) + question
    reference = hf_forward(model, ids, device)
    out = {"prompt_tokens": len(ids), "max_abs_logit": float(reference.abs().max())}
    own = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            cache, half = DynamicCache(config=model.config), len(ids) // 2
            model(input_ids=torch.tensor([ids[:half]], device=device), cache=cache, use_cache=True)
            two = model(input_ids=torch.tensor([ids[half:]], device=device), cache=cache, use_cache=True,
                        logits_to_keep=1).logits[0, -1].float().cpu()
    finally:
        model.set_attn_implementation(own)
    out["hf two pieces vs hf"] = compare(reference, two)
    if len(ids) <= 8192:  # eager materialises the scores
        out["hf eager vs hf sdpa"] = compare(reference, hf_forward(model, ids, device, "eager"))
    out["full_prefill vs hf"] = compare(reference, blender.full_prefill(ids).logits)
    head_kv = blender.precompute(head)
    kvs = [blender.precompute(c, head, context=head_kv) for c in chunks]
    blended = blender.prefill([head_kv, *kvs], question, 1.0)
    out["blend@1 vs hf"] = {**compare(reference, blended.logits), "fallback": blended.stats.fallback}
    return out


def tier_stores(tmp: Path, placement):
    """The memory and disk tiers at the model's placement (Backend.placement), or why they are not measured
    (store's dependencies missing)."""
    try:
        from store import DiskTier, MemoryTier, TieredStore, kv_key
    except ImportError as exc:
        return None, None, f"store does not import here ({exc}): tier cases skipped"
    stores = {"memory": TieredStore([MemoryTier(1 << 38, pin=placement.pin)], placement=placement),
              "disk": TieredStore([DiskTier(tmp, 1 << 38)], placement=placement)}
    return stores, kv_key, None


def measure(blender: Blender, device, tokens: int, args, tmp: Path, report: Report) -> None:
    model = blender.model
    head, chunks, question = prompt(model.config.vocab_size, tokens, args.chunk, seed=tokens)
    ids = head + sum(chunks, []) + question
    run = report.data["runs"].setdefault(str(len(ids)), {})
    head_kv = blender.precompute(head)
    kvs = [blender.precompute(c, head, context=head_kv) for c in chunks]
    placement = blender.backend.placement
    stores, kv_key, why = tier_stores(tmp / f"disk-{tokens}", placement) if tokens <= args.tier_tokens else (
        None, None, f"tier cases run up to {args.tier_tokens} tokens")
    keys = []
    if stores:
        keys = [kv_key(blender.fingerprint, kv.context_hash, kv.token_ids) for kv in kvs]
        for store in stores.values():
            for key, kv in zip(keys, kvs):
                store.put(key, kv)
    else:
        run["tiers"] = why

    def case(name: str, fn) -> None:
        with recorded(run, name, f"{len(ids)} {name}", device, report):
            seconds, result = timed(fn, device, args.repeats)
            run[name] = {"s": round(seconds, 4)}
            stats = getattr(result, "stats", None)
            if stats is not None:
                run[name].update(phases_ms=stats.timings_ms, load_wait_ms=stats.load_wait_ms,
                                 recomputed=stats.recomputed_tokens, fallback=stats.fallback)
            log(f"  {len(ids)} {name}: {seconds:.4f} s")

    def blend(segments, ratio: float, selection: str = "query", pipeline: bool = False):
        return lambda: blender.prefill([head_kv, *segments()], question, ratio, selection=selection, pipeline=pipeline)

    resident = lambda: kvs  # noqa: E731
    case("hf sdpa full", lambda: hf_forward(model, ids, device))
    case("full_prefill", lambda: blender.full_prefill(ids))
    case("full through the blend attention", lambda: blender.prefill([], ids, 1.0))
    case("resident reuse", blend(resident, 0.0))
    for ratio in (0.15, 0.3):
        for selection in ("query", "hkvd"):
            case(f"resident blend@{ratio} {selection}", blend(resident, ratio, selection))
    if stores:
        for tier in stores:
            opened = lambda tier=tier: [stores[tier].open(k) for k in keys]  # noqa: E731
            for pipeline in (True, False):
                way = "pipelined" if pipeline else "whole"
                case(f"{tier} reuse {way}", blend(opened, 0.0, pipeline=pipeline))
                case(f"{tier} blend@0.15 query {way}", blend(opened, 0.15, pipeline=pipeline))
        for store in stores.values():
            store.close()


def random_kv(shape: tuple[int, int, int, int], dtype: torch.dtype, seed: int):
    """A ChunkKV of gaussian keys/values [L, H, T, D] in `dtype` on the host, one key channel 20x the others (as
    real keys have outlier channels)."""
    from common.chunk_kv import ChunkKV
    g = torch.Generator().manual_seed(seed)
    keys, values = (torch.randn(shape, generator=g) for _ in range(2))
    keys[..., 3] *= 20
    ids = torch.randint(10, 1000, (shape[2],), generator=g)
    return ChunkKV(keys.to(dtype), values.to(dtype), ids, 0, f"ctx{seed}", "device-check")


def codec_check(device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int, int], chunks: int,
                repeats: int, tmp: Path, report: Report) -> None:
    """Each store codec on `device`: `chunks` random chunks of `shape` stored on disk, read layer by layer onto the
    device in `dtype`; per layer |x - decoded| within the codec's bound (plus `dtype`'s rounding); decode MB/s of
    the KV delivered in `dtype` (medians of `repeats` reads of every layer of every chunk)."""
    out = report.data.setdefault("codecs", {})
    try:
        from store import CODEC_NAMES, CacheGenTables, DiskTier, TieredStore, get_codec, kv_key, register_tables
        from store.codecs import DEFAULT_BINS
    except ImportError as exc:
        out["skipped"] = f"store does not import here ({exc})"
        report.dump()
        return
    placement = Placement(device, on_host=device.type == "cpu", pin=device.type == "cuda")
    kvs = [random_kv(shape, dtype, seed) for seed in range(chunks)]
    keys = [kv_key(kv.fingerprint, kv.context_hash, kv.token_ids) for kv in kvs]
    eps = torch.finfo(dtype).eps if dtype != torch.float32 else 1e-6
    for name in CODEC_NAMES:
        with recorded(out, name, f"codec {name}", device, report):
            codec = register_tables(CacheGenTables.fit([random_kv(shape, dtype, 100 + i) for i in range(2)],
                                                       DEFAULT_BINS)) if name == "cachegen" else get_codec(name)
            with TieredStore([DiskTier(tmp / f"codec-{name}", 1 << 38)], codec=codec, fingerprint="device-check",
                             placement=placement) as store:
                start = time.perf_counter()
                for key, kv in zip(keys, kvs):
                    store.put(key, kv)
                store.flush()
                encode_s = time.perf_counter() - start

                def read_all():
                    layers = []
                    for key in keys:
                        with store.open(key) as entry:
                            layers.append([entry.layer(i, device, dtype) for i in range(entry.num_layers)])
                    return layers
                seconds, layers = timed(read_all, device, repeats)
                worst = 0.0  # the largest error as a share of what the bound allows (<= 1 passes)
                for kv, chunk in zip(kvs, layers):
                    bounds = codec.error_bound(codec.pack(kv.keys, kv.values), shape[2])
                    for want, got, bound in zip((kv.keys, kv.values), zip(*chunk), bounds):
                        got = torch.stack(got).float().cpu()  # [L, H, T, D]
                        x = want.float()
                        allowed = bound * (1 + 1e-4) + eps * (x.abs() + bound) + 2.0 ** -24
                        worst = max(worst, float(((x - got).abs() / allowed).max()))
                out_bytes = sum(kv.keys.nbytes + kv.values.nbytes for kv in kvs)
                out[name] = {"within_bound": worst <= 1.0, "worst_share_of_bound": round(worst, 4),
                             "decode_mb_s": round(out_bytes / seconds / 1e6, 1),
                             "encode_mb_s": round(out_bytes / encode_s / 1e6, 1),
                             "stored_mb": round(store.stats()["tiers"]["disk"]["bytes"] / 1e6, 2)}
            log(f"  codec {name}: {out[name]}")


def decode(blender: Blender, device, context: int, batches: list[int], steps: int, report: Report) -> None:
    """DecodeRuntime.step over batches of pooled requests (blend.pool), and the model's own forward at batch 1."""
    out = report.data["decode"]
    vocab = blender.model.config.vocab_size
    g = torch.Generator().manual_seed(7)
    runtime = DecodeRuntime(blender, slots=max(batches), max_len=context + 2 * steps + 8)
    out["step"] = {"form": type(runtime.form).__name__, "kernel_step_refusal": runtime.kernel_step_refusal}
    for batch in batches:
        sequences = []
        try:
            prefill = blender.full_prefill(torch.randint(10, vocab, (context,), generator=g).tolist(),
                                           reserve=2 * steps + 4)
            sampling = SamplingParams(max_new_tokens=steps + 2)
            sequences = [runtime.start(prefill, sampling) for _ in range(batch)]
            positions = [context] * batch
            runtime.step(sequences, [11] * batch, positions)  # warm-up (on CUDA: captures its graph)
            positions = [p + 1 for p in positions]
            sync(device)
            start = time.perf_counter()
            for _ in range(steps):
                runtime.step(sequences, [12] * batch, positions)
                positions = [p + 1 for p in positions]
            sync(device)
            step = (time.perf_counter() - start) / steps
            out[f"batch {batch}"] = {"step_ms": round(step * 1000, 2), "tokens_per_s": round(batch / step, 1),
                                     "graphs": runtime.cuda_graphs or "on"}
            if batch == 1:  # the model's own forward, one row: what the batched step must not be slower than
                cache, position = prefill.cache, context
                with torch.inference_mode():
                    sync(device)
                    start = time.perf_counter()
                    for _ in range(steps):
                        blender.model(input_ids=torch.tensor([[12]], device=device), use_cache=True, cache=cache,
                                      position_ids=torch.tensor([[position]], device=device))
                        position += 1
                    sync(device)
                out["own forward batch 1"] = {"step_ms": round((time.perf_counter() - start) / steps * 1000, 2)}
            out[f"batch {batch} masked"] = masked_steps(runtime, sequences, positions, vocab, steps, device)
            log(f"  decode batch {batch} @ {context}: {out[f'batch {batch}']}, masked {out[f'batch {batch} masked']}")
        except Exception as exc:  # noqa: BLE001
            out[f"batch {batch}"] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-1200:]}
        finally:
            for sequence in sequences:
                sequence.release()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        report.dump()


class BandMask:
    """A grammar's stand-in for the masked step (blend.grammar.Constraint's interface): tokens [lo, hi) allowed.
    The mask is built on the host and applied on the device inside the one step, as a real grammar's is."""

    def __init__(self, vocab: int, lo: int, hi: int):
        allowed = np.zeros(((vocab + 31) // 32) * 32, dtype=np.uint8)
        allowed[lo:hi] = 1
        self.words = torch.from_numpy(np.packbits(allowed, bitorder="little").view(np.int32).copy())
        self.lo, self.hi, self.finished = lo, hi, False

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = self.words

    def advance(self, token: int) -> None:
        pass


def masked_steps(runtime: DecodeRuntime, sequences: list, positions: list[int], vocab: int, steps: int,
                 device: torch.device) -> dict:
    """The same rows stepped under a mask on every row but the first (rows with and without a grammar share the
    step): ms a step, and whether every masked row's token stayed inside its band."""
    bands = [None] + [BandMask(vocab, 100 + 50 * b, 150 + 50 * b) for b in range(1, len(sequences))]
    for sequence, band in zip(sequences, bands):
        sequence.constraint = band
    inside, taken = True, []
    runtime.step(sequences, [12] * len(sequences), positions)  # warm-up (on CUDA: the masked graph's capture)
    positions = [p + 1 for p in positions]
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        taken = runtime.step(sequences, [12] * len(sequences), positions)
        positions = [p + 1 for p in positions]
        inside = inside and all(band.lo <= t < band.hi for t, band in zip(taken, bands) if band is not None)
    sync(device)
    for sequence in sequences:
        sequence.constraint = None
    return {"step_ms": round((time.perf_counter() - start) / steps * 1000, 2), "tokens_inside_masks": inside}


def table(data: dict) -> list[str]:
    """The short summary: each case's seconds and its share of HF's own full prefill."""
    lines = [f"commit {data.get('commit')}  device {data.get('device')}  gate: {data.get('gate')}"]
    for tokens, run in data["runs"].items():
        if not isinstance(run, dict):
            lines.append(f"{tokens}: {run}")
            continue
        base = (run.get("hf sdpa full") or {}).get("s")
        for name, v in run.items():
            if isinstance(v, dict) and "s" in v:
                share = f"{v['s'] / base:6.3f}x" if base else ""
                assemble = (v.get("phases_ms") or {}).get("assemble")
                extra = f"  assemble {assemble:.1f} ms" if assemble is not None else ""
                lines.append(f"{tokens:>6} {name:<34} {v['s']:8.4f} s {share}{extra}")
            elif isinstance(v, dict):
                lines.append(f"{tokens:>6} {name:<34} {v.get('error', '')[:120]}")
    for name, v in data.get("decode", {}).items():
        if "form" in v:
            lines.append(f"decode step: {v['form']} ({v['kernel_step_refusal'] or 'the kernel step'})")
        else:
            lines.append(f"decode {name:<27} {v.get('step_ms', v.get('error', ''))} ms")
    for name, v in data.get("codecs", {}).items():
        lines.append(f"codec {name:<28} " + (f"decode {v['decode_mb_s']} MB/s, within bound: {v['within_bound']}"
                                              if isinstance(v, dict) and "decode_mb_s" in v else str(v)[:120]))
    for dtype, ex in data.get("exactness", {}).items():
        if isinstance(ex, dict):
            lines.append(f"exactness {dtype}: " + ", ".join(
                f"{k} {v['max_abs']:.3g}/{'=' if v['top1'] else '≠'}" for k, v in ex.items() if isinstance(v, dict)))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "device-check")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (the CPU smoke test)")
    parser.add_argument("--tokens", default=None, help="prompt lengths (default 4096,16384,32768; tiny: 512)")
    parser.add_argument("--chunk", type=int, default=None, help="chunk tokens (default 512; tiny: 128)")
    parser.add_argument("--tier-tokens", type=int, default=16384, help="tier cases up to this prompt length")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", help="the measured model's dtype (exactness: float32 too)")
    parser.add_argument("--exact-tokens", type=int, default=None, help="(default 4096; tiny: 300)")
    parser.add_argument("--decode-context", type=int, default=None, help="(default 4096; tiny: 128)")
    parser.add_argument("--decode-batches", default="1,8,32")
    parser.add_argument("--codec-tokens", type=int, default=None, help="tokens a codec chunk (default 512; tiny: 40)")
    parser.add_argument("--only", choices=["codecs"], default=None, help="run that part alone")
    args = parser.parse_args()
    tiny = args.tiny
    args.tokens = args.tokens or ("512" if tiny else "4096,16384,32768")
    args.chunk = args.chunk or (128 if tiny else 512)
    args.exact_tokens = args.exact_tokens or (300 if tiny else 4096)
    args.decode_context = args.decode_context or (128 if tiny else 4096)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"gpu": False, "message": "no CUDA GPU on this machine: nothing to check"}))
        return
    import transformers
    report = Report(args.out)
    report.data.update(commit=git_commit(), torch=torch.__version__, transformers=transformers.__version__,
                       device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                       model="tiny llama" if tiny else "llama-3-8b shape, random weights",
                       gates={}, exactness={}, runs={}, decode={})
    started = time.perf_counter()
    config = TINY if tiny else LLAMA3_8B
    kv_shape = (config["num_hidden_layers"], config["num_key_value_heads"], args.codec_tokens or (40 if tiny else 512),
                config["hidden_size"] // config["num_attention_heads"])
    if args.only == "codecs":
        with tempfile.TemporaryDirectory() as tmp:
            codec_check(device, getattr(torch, args.dtype), kv_shape, 2, args.repeats, Path(tmp), report)
        print("\n".join(table(report.data)))
        print(f"JSON: {report.path}")
        return
    # float32 first (is the loop exact where rounding is small?), then the model that is measured.
    measured = getattr(torch, args.dtype)
    for dtype in dict.fromkeys((torch.float32, measured)):
        log(f"building the {dtype} model")
        start = time.perf_counter()
        blender = Blender(build_model(device, tiny, dtype), tokenizer=None, fingerprint=f"device-check-{dtype}")
        report.data["gates"][str(dtype)] = {"unsupported": blender.unsupported, "backend": blender.backend.name,
                                           "build_and_gate_s": round(time.perf_counter() - start, 2)}
        try:
            report.data["exactness"][str(dtype)] = exactness(blender, device, args.exact_tokens, args.chunk)
        except Exception as exc:  # noqa: BLE001
            report.data["exactness"][str(dtype)] = f"{type(exc).__name__}: {exc} {traceback.format_exc()[-800:]}"
        report.dump()
        if dtype != measured:
            del blender
            if device.type == "cuda":
                torch.cuda.empty_cache()
    report.data["gate"] = blender.unsupported or "accepted"
    assert blender.unsupported or blender.model.config._attn_implementation == BLEND_ATTENTION
    with tempfile.TemporaryDirectory() as tmp:
        for tokens in (int(t) for t in args.tokens.split(",")):
            log(f"{tokens} tokens")
            try:
                measure(blender, device, tokens, args, Path(tmp), report)
            except Exception as exc:  # noqa: BLE001
                report.data["runs"][f"{tokens} error"] = f"{type(exc).__name__}: {exc} {traceback.format_exc()[-1200:]}"
            if device.type == "cuda":
                torch.cuda.empty_cache()
            report.dump()
    decode(blender, device, args.decode_context, [int(b) for b in args.decode_batches.split(",")], 16, report)
    report.data["total_s"] = round(time.perf_counter() - started, 1)
    report.dump()
    print("\n".join(table(report.data)))
    print(f"JSON: {report.path}")


if __name__ == "__main__":
    main()
