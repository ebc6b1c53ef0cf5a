"""Store benchmark: bytes per token per codec, and the time to load one 512-token chunk's KV from
each tier against the time to recompute it (a prefill of a SmolLM2-135M-shaped model).

    python bench/store.py [--tokens 512] [--repeats 5]

Prints JSON on stdout, progress on stderr. Starts its own redis-server on a free port. The KV
is random (the store does not care); the model is randomly initialised (same compute as the real
one). Disk reads come from the page cache, as they would for a hot chunk.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
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
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


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


def tier_get_s(tier, codec: str, key: str, kv, repeats: int) -> float:
    """Median time of TieredStore.get (tier read + checks + decode) with `tier` as the only tier."""
    store = TieredStore([tier], codec=codec, fingerprint=FINGERPRINT)
    store.put(key, kv)
    store.flush()
    assert store.get(key) is not None, f"{tier.name}: entry did not come back"
    seconds = median_s(lambda: store.get(key), repeats)
    store.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

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
                get_s = tier_get_s(tier, codec, key, kv, args.repeats)
                by_codec[codec][name] = {"get_s": round(get_s, 6),
                                         "ratio_to_recompute": round(get_s / recompute, 5)}
                log(f"{codec:>4} {name:>6}: get {get_s * 1e3:7.2f} ms ({recompute / get_s:5.1f}x faster than recompute)")

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
