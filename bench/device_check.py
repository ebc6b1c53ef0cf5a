"""TTFTs on a CUDA GPU (run by bench/device_check.sh): SmolLM2 and a random Llama-3-8B-shaped model in bfloat16.

For each model and prompt length (4k, 16k tokens; SmolLM2 only where its context allows): chunks of
--chunk random tokens after a 32-token head, a 32-token question; every chunk's KV stored (fp16) in a
memory tier and a disk tier. Modes: full prefill, reuse (ratio 0) and blend@0.15, each with KV from
memory and from disk, pipelined and not. Medians of --repeats, CUDA-synchronised. Prints JSON.
The 8B-shaped model has random weights (config only, nothing downloaded): its timings mean something,
its answers do not.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from blend import Blender, load_model  # noqa: E402
from common import git_commit  # noqa: E402
from store import DiskTier, MemoryTier, TieredStore, kv_key  # noqa: E402

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
                 rope_theta=500000.0, rms_norm_eps=1e-5)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def random_llama(device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with device:
            model = LlamaForCausalLM(LlamaConfig(**LLAMA3_8B)).eval()
    finally:
        torch.set_default_dtype(default)
    return Blender(model, tokenizer=None, fingerprint="random-llama3-8b-shape")


def measure(blender: Blender, tokens: int, chunk: int, repeats: int, tmp: Path) -> dict:
    vocab = blender.model.config.vocab_size
    g = torch.Generator().manual_seed(tokens)
    ids = lambda n: torch.randint(10, vocab, (n,), generator=g).tolist()  # noqa: E731
    head_ids, suffix = ids(32), ids(32)
    chunks = [ids(chunk) for _ in range(max(1, (tokens - 64) // chunk))]
    head = blender.precompute(head_ids)
    stores = {"memory": TieredStore([MemoryTier(1 << 36)]),
              "disk": TieredStore([DiskTier(tmp / f"disk-{tokens}-{blender.fingerprint}", 1 << 36)])}
    keys = []
    for c in chunks:
        kv = blender.precompute(c, head_ids, context=head)
        key = kv_key(blender.fingerprint, kv.context_hash, kv.token_ids)
        for store in stores.values():
            store.put(key, kv)
        keys.append(key)
    del kv

    def once(mode: str, tier: str | None, pipeline: bool) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        if mode == "full":
            prefill = blender.full_prefill(head_ids + sum(chunks, []) + suffix)
        else:
            entries = [stores[tier].open(k) for k in keys]
            prefill = blender.prefill([head, *entries], suffix, 0.0 if mode == "reuse" else 0.15, pipeline=pipeline)
        int(prefill.logits.argmax())
        torch.cuda.synchronize()
        return time.perf_counter() - start

    cases = [("full", None, False)] + [(m, t, p) for m in ("reuse", "blend@0.15") for t in stores
                                        for p in (True, False)]
    once(*cases[1])  # warm-up
    times = {c: [] for c in cases}
    for _ in range(repeats):
        for case in cases:
            times[case].append(once(*case))
    for store in stores.values():
        store.close()
    out = {"prompt_tokens": 64 + len(chunks) * chunk, "full_s": round(statistics.median(times[cases[0]]), 4)}
    for mode, tier, pipeline in cases[1:]:
        out[f"{mode} {tier} {'pipelined' if pipeline else 'whole'}_s"] = round(
            statistics.median(times[(mode, tier, pipeline)]), 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="4096,16384")
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tests-rc", type=int, default=None, help="exit status of the CUDA blend tests")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"gpu": False, "message": "no CUDA GPU on this machine: nothing to check"}))
        return
    device = torch.device("cuda")
    result = {"gpu": True, "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "blend_tests_rc": args.tests_rc, "models": {}}
    result["commit"] = git_commit()
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("smollm2", "llama3-8b-shape"):
            log(f"loading {name}")
            if name == "smollm2":
                llm = load_model("embedded", cache_dir=REPO / "data/models", dtype="auto", device="cuda")
                blender = Blender(llm.model, llm.tokenizer, llm.fingerprint)
            else:
                blender = random_llama(device)
            limit = blender.model.config.max_position_embeddings
            runs = {}
            for tokens in (int(t) for t in args.tokens.split(",")):
                if tokens > limit:
                    runs[str(tokens)] = f"skipped: the model's context is {limit} tokens"
                    continue
                log(f"{name} at {tokens} tokens")
                try:
                    runs[str(tokens)] = measure(blender, tokens, args.chunk, args.repeats, Path(tmp))
                except torch.cuda.OutOfMemoryError as exc:
                    runs[str(tokens)] = f"out of GPU memory: {exc}"
                torch.cuda.empty_cache()
            result["models"][name] = {"unsupported": blender.unsupported, "dtype": str(blender.dtype), "runs": runs}
            del blender
            torch.cuda.empty_cache()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
