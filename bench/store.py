"""Store benchmark: bytes per token per codec, the time to load one 512-token chunk's KV from
each tier against the time to recompute it (a prefill of a SmolLM2-135M-shaped model), and
per-layer reads: one layer against the whole chunk, per tier.

    python bench/store.py [--tokens 512] [--repeats 5] [--threads N]

Prints JSON on stdout, progress on stderr. Starts its own redis-server on a free port. The KV
is random (the store does not care); the model is randomly initialised (same compute as the real
one). Disk reads come from the page cache, as they would for a hot chunk.

Per tier and codec: `get_s` (TieredStore.get: read, check, decode the whole chunk), and under
`layers`: `open_s` (TieredStore.open: the head alone), `layer_s` (entry.layer(i) for one layer
of an open entry), `all_layers_s` (open + every layer in turn: what a pipelined loader spends
in all), and `layer_to_get` = layer_s / get_s. Every repeat times each of these once, interleaved,
so the ratios compare like with like; each figure is the median over repeats (layer_s: over
repeats x all layers).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from store import CODECS, DiskTier, MemoryTier, RedisTier, TieredStore, bytes_per_token  # noqa: E402
from tests.helpers import random_kv
from tests.servers import RedisServer  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64  # SmolLM2-135M
FINGERPRINT = "bench-smollm2-135m-shape"


def log(msg: str) -> None:
    print(f"[bench/store] {msg}", file=sys.stderr, flush=True)


def median_s(fn: Callable[[], object], repeats: int) -> float:
    return statistics.median(timed(fn) for _ in range(repeats))


def recompute_s(tokens: int, repeats: int) -> float:
    """Median time of a `tokens`-long prefill of a random SmolLM2-135M-shaped Llama in float32.

    Logits for the last position only, as a prefill needs (and chunk precompute needs none).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=LAYERS,
                         num_attention_heads=9, num_key_value_heads=KV_HEADS, vocab_size=49152,
                         max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, tokens))  # [B, T]
    with torch.inference_mode():
        model(ids, use_cache=True, logits_to_keep=1)  # warm-up
        return median_s(lambda: model(ids, use_cache=True, logits_to_keep=1), repeats)


def tier_times(tier, codec: str, key: str, kv, repeats: int) -> dict[str, float]:
    """Whole-chunk get, open, one layer and all layers from `tier` as the only tier, interleaved."""
    store = TieredStore([tier], codec=codec, fingerprint=FINGERPRINT)
    store.put(key, kv)
    store.flush()
    assert store.get(key) is not None, f"{tier.name}: entry did not come back"
    times: dict[str, list[float]] = {"get_s": [], "open_s": [], "layer_s": [], "all_layers_s": []}
    for _ in range(repeats):
        times["get_s"].append(timed(lambda: store.get(key)))
        start = time.perf_counter()
        entry = store.open(key)
        times["open_s"].append(time.perf_counter() - start)
        for i in range(entry.num_layers):
            times["layer_s"].append(timed(partial(entry.layer, i)))
        times["all_layers_s"].append(time.perf_counter() - start)
        entry.close()
    store.close()
    return {name: statistics.median(values) for name, values in times.items()}


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    shape = (LAYERS, KV_HEADS, args.tokens, HEAD_DIM)
    key, kv = random_kv(0, shape=shape, fingerprint=FINGERPRINT)  # float32, as the model computes it
    log(f"chunk KV {list(shape)} float32: {kv.nbytes / 2**20:.1f} MiB")

    log("timing recompute (random SmolLM2-135M-shaped model, float32, median of 3)")
    recompute = recompute_s(args.tokens, repeats=3)
    log(f"recompute {recompute * 1e3:.1f} ms")

    by_codec = {}
    with RedisServer() as redis_server, tempfile.TemporaryDirectory() as tmp:
        for codec in CODECS:
            tiers = {"memory": MemoryTier(1 << 30), "disk": DiskTier(Path(tmp) / codec, 1 << 30),
                     "redis": RedisTier(redis_server.url, timeout_s=5.0)}
            by_codec[codec] = {}
            for name, tier in tiers.items():
                t = tier_times(tier, codec, key, kv, args.repeats)
                by_codec[codec][name] = {
                    "get_s": round(t["get_s"], 6), "ratio_to_recompute": round(t["get_s"] / recompute, 5),
                    "layers": {"open_s": round(t["open_s"], 6), "layer_s": round(t["layer_s"], 6),
                               "all_layers_s": round(t["all_layers_s"], 6),
                               "layer_to_get": round(t["layer_s"] / t["get_s"], 4)}}
                log(f"{codec:>4} {name:>6}: get {t['get_s'] * 1e3:7.2f} ms ({recompute / t['get_s']:5.1f}x faster "
                    f"than recompute); open {t['open_s'] * 1e3:6.3f} ms, one layer {t['layer_s'] * 1e3:6.3f} ms, "
                    f"all layers {t['all_layers_s'] * 1e3:7.2f} ms")

    print(json.dumps({
        "chunk": {"layers": LAYERS, "kv_heads": KV_HEADS, "tokens": args.tokens, "head_dim": HEAD_DIM},
        "recompute_s": round(recompute, 6),
        "codec": "fp16",
        "tiers": by_codec["fp16"],
        "tiers_int8": by_codec["int8"],
        "bytes_per_token": {codec: bytes_per_token(codec, shape) for codec in CODECS},
        "torch_threads": torch.get_num_threads(),
    }, indent=2))


if __name__ == "__main__":
    main()
