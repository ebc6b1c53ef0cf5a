"""Store benchmark: per tier and codec, the bandwidth of read + verify + decode into the model's dtype
(on the model's device), next to the time to recompute the chunk (a prefill of a SmolLM2-135M-shaped
model), and a loader's pattern: layer i of several open chunks in turn, serial and read ahead on the pool.

    python bench/store.py [--tokens 512] [--chunks 8] [--repeats 5] [--device cpu|cuda] [--threads N]
                          [--codecs native,fp16,int8,int4,cachegen]

Prints JSON on stdout, progress on stderr. Starts its own redis-server on a free port (skipped when
redis-server is missing). The KV is random (the store does not care); the model is randomly initialised
(same compute as the real one). Disk reads come from the page cache, as they would for a hot chunk.
`--device cuda` (bench/device_check.sh): the model off the host (its Placement): bfloat16, layers land on
the GPU, a gpu tier and a pinned memory tier; every timing synchronises the device.

Per codec and tier: `get_s` (TieredStore.get: read, check, decode the whole chunk), `all_layers_s`
(open + entry.layer(i, device, dtype) for every layer: what a pipelined loader spends), and
`get_gbps` / `layers_gbps`: the KV delivered in the model's dtype per second (GB = 1e9 bytes);
`loader_serial_s` / `loader_parallel_s`: `--chunks` chunks opened together, layer i of each in turn
(read_threads 0 against the default pool). Medians over repeats, interleaved.

`rates`, per KV shape (SmolLM2-135M's and Llama-3-8B's) and codec: `bytes_per_token` (the encoded entry,
header excluded), `encode_mb_s` (KV in the model's dtype in, per second), `decode_mb_s` (a whole entry
decoded into the model's dtype on the host, KV out per second: `decode`) and `layer_decode_mb_s` (every
layer through `layer_parts` + `unpack_parts`, as a loader reads it), MB = 1e6 bytes. The data is random
(gaussian, one key channel 20x the others), so cachegen's bytes here are not its bytes on a real model's
KV (bench/kv_bytes.py measures those); its tables are fitted on other random chunks of the same shape.
Its speed does not depend on that.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.placement import HOST, Placement  # noqa: E402
from store import (  # noqa: E402
    CODEC_NAMES,
    CacheGenTables,
    DiskTier,
    MemoryTier,
    RedisTier,
    TieredStore,
    decode,
    encode,
    get_codec,
    register_tables,
)
from store.codecs import Codec  # noqa: E402
from store.serialize import parse_head  # noqa: E402
from tests.helpers import random_kv  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64  # SmolLM2-135M
SHAPES = {"smollm2-135m": (LAYERS, KV_HEADS, HEAD_DIM), "llama-3-8b": (32, 8, 128)}  # [L, H, D]
FINGERPRINT = "bench-smollm2-135m-shape"


def log(msg: str) -> None:
    print(f"[bench/store] {msg}", file=sys.stderr, flush=True)


def placement_for(device: str) -> Placement:
    """The model's Placement for `--device`, as blend's backend gives it (host memory; else the device, its
    host buffers pinned)."""
    dev = torch.device(device)
    return HOST if dev == HOST.device else Placement(dev, on_host=False, pin=True)


def timed(fn: Callable[[], object], placement: Placement) -> float:
    sync = (lambda: None) if placement.on_host else (lambda: torch.cuda.synchronize(placement.device))
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def recompute_s(tokens: int, repeats: int, placement: Placement, dtype: torch.dtype) -> float:
    """Median time of a `tokens`-long prefill of a random SmolLM2-135M-shaped Llama (last logits only)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=LAYERS,
                         num_attention_heads=9, num_key_value_heads=KV_HEADS, vocab_size=49152,
                         max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True)
    model = LlamaForCausalLM(config).to(placement.device, dtype).eval()
    ids = torch.randint(0, config.vocab_size, (1, tokens), device=placement.device)  # [B, T]
    with torch.inference_mode():
        model(ids, use_cache=True, logits_to_keep=1)  # warm-up
        return statistics.median(timed(lambda: model(ids, use_cache=True, logits_to_keep=1), placement)
                                 for _ in range(repeats))


def codec_for(name: str, shape: tuple[int, int, int, int], dtype: torch.dtype, fingerprint: str) -> Codec:
    """The codec `name`; cachegen with tables fitted on 4 random chunks of `shape` (seeds apart from the measured)."""
    if name != "cachegen":
        return get_codec(name)
    samples = [random_kv(10_000 + i, shape=shape, fingerprint=fingerprint, dtype=dtype)[1] for i in range(4)]
    return register_tables(CacheGenTables.fit(samples, get_codec("cachegen").plan))


def codec_rates(codec: Codec, kv, repeats: int) -> dict[str, float]:
    """bytes/token and encode / whole decode / layer-by-layer decode rates of one codec on `kv`, on the host."""
    data = encode(kv, codec)
    head = parse_head(data)

    def layers() -> None:
        for i in range(head.num_layers):
            offset, length = head.layer_range(i)
            head.unpack_parts(head.layer_parts(i, torch.frombuffer(bytearray(data[offset:offset + length]),
                                                                   dtype=torch.uint8)))

    times = {case: statistics.median(timed(fn, HOST) for _ in range(repeats)) for case, fn in
             {"encode": lambda: encode(kv, codec), "decode": lambda: decode(data), "layers": layers}.items()}
    mb = kv.nbytes / 1e6
    return {"bytes_per_token": round((len(data) - head.payload_start) / kv.num_tokens, 1),
            "encode_mb_s": round(mb / times["encode"], 1), "decode_mb_s": round(mb / times["decode"], 1),
            "layer_decode_mb_s": round(mb / times["layers"], 1)}


def make_tiers(name: str, root: Path, redis_url: str | None, placement: Placement) -> list:
    return {"gpu": lambda: [MemoryTier(1 << 34, device=placement.device, name="gpu")],
            "memory": lambda: [MemoryTier(1 << 34, pin=placement.pin)],
            "disk": lambda: [DiskTier(root / name, 1 << 34)],
            "redis": lambda: [RedisTier(redis_url, timeout_s=10.0, prefix=f"{root.name}:")]}[name]()


def tier_times(name: str, codec: Codec, chunks: list, root: Path, redis_url: str | None, placement: Placement,
               repeats: int) -> dict[str, float]:
    """Timings of one tier as the only tier, every figure once per repeat, interleaved."""
    stores = {threads: TieredStore(make_tiers(name, root / f"{codec.name}-{threads}", redis_url, placement),
                                   codec=codec, fingerprint=FINGERPRINT, placement=placement, read_threads=threads)
              for threads in (0, 4)}
    for store in stores.values():
        for key, kv in chunks:
            store.put(key, kv)  # a tensor tier places it on its device
        store.flush()
    dtype = chunks[0][1].keys.dtype
    key = chunks[0][0]
    store = stores[4]
    assert store.get(key) is not None, f"{name}: entry did not come back"

    device = placement.device

    def all_layers() -> None:
        with store.open(key) as entry:
            for i in range(entry.num_layers):
                entry.layer(i, device, dtype)

    def loader(s: TieredStore) -> Callable[[], None]:
        def run() -> None:  # blend.pipeline.LayerLoader's order: layer i of every chunk, then layer i+1
            entries = [s.open(k) for k, _ in chunks]
            for i in range(LAYERS):
                for entry in entries:
                    entry.layer(i, device, dtype)
            for entry in entries:
                entry.close()
        return run

    cases = {"get_s": lambda: store.get(key), "all_layers_s": all_layers,
             "loader_serial_s": loader(stores[0]), "loader_parallel_s": loader(stores[4])}
    times: dict[str, list[float]] = {case: [] for case in cases}
    for _ in range(repeats):
        for case, fn in cases.items():
            times[case].append(timed(fn, placement))
    for s in stores.values():
        s.close()
    return {case: statistics.median(values) for case, values in times.items()}


def run(tokens: int = 512, chunks: int = 8, repeats: int = 5, device: str = "cpu",
        codecs: tuple[str, ...] = CODEC_NAMES) -> dict:
    """The benchmark as a dict (bench/device_check.py may call this with device="cuda")."""
    placement = placement_for(device)
    dtype = torch.float32 if placement.on_host else torch.bfloat16
    shape = (LAYERS, KV_HEADS, tokens, HEAD_DIM)
    kvs = [random_kv(i, shape=shape, fingerprint=FINGERPRINT, dtype=dtype) for i in range(chunks)]
    kv_bytes = kvs[0][1].nbytes
    log(f"chunk KV {list(shape)} {dtype}: {kv_bytes / 2**20:.1f} MiB; {chunks} chunks for the loader pattern")
    recompute = recompute_s(tokens, 3, placement, dtype)
    log(f"recompute {recompute * 1e3:.1f} ms")
    names = ([] if placement.on_host else ["gpu"]) + ["memory", "disk"]
    by_codec: dict[str, dict] = {}
    redis_server = None
    if shutil.which("redis-server"):
        from tests.servers import RedisServer
        redis_server = RedisServer().__enter__()
        names.append("redis")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for codec in codecs:
                by_codec[codec] = {}
                coder = codec_for(codec, shape, dtype, FINGERPRINT)
                for name in names:
                    t = tier_times(name, coder, kvs, Path(tmp), redis_server and redis_server.url, placement, repeats)
                    gb = lambda s, n=1: round(n * kv_bytes / s / 1e9, 3)  # noqa: E731
                    by_codec[codec][name] = {
                        **{k: round(v, 6) for k, v in t.items()},
                        "get_gbps": gb(t["get_s"]), "layers_gbps": gb(t["all_layers_s"]),
                        "loader_serial_gbps": gb(t["loader_serial_s"], chunks),
                        "loader_parallel_gbps": gb(t["loader_parallel_s"], chunks),
                        "get_to_recompute": round(t["get_s"] / recompute, 5)}
                    log(f"{codec:>6} {name:>6}: get {t['get_s'] * 1e3:7.2f} ms ({gb(t['get_s']):6.2f} GB/s), "
                        f"layers {t['all_layers_s'] * 1e3:7.2f} ms, loader {chunks} chunks serial "
                        f"{t['loader_serial_s'] * 1e3:7.2f} / parallel {t['loader_parallel_s'] * 1e3:7.2f} ms")
    finally:
        if redis_server is not None:
            redis_server.__exit__(None, None, None)
    rates = {}
    for model, (L, H, D) in SHAPES.items():
        kv = random_kv(1, shape=(L, H, tokens, D), fingerprint=model)[1]  # float32: what the host decodes into
        rates[model] = {}
        for codec in codecs:
            rates[model][codec] = codec_rates(codec_for(codec, tuple(kv.keys.shape), kv.keys.dtype, model), kv, repeats)
            log(f"{model} {codec:>8}: {rates[model][codec]}")
    return {"chunk": {"layers": LAYERS, "kv_heads": KV_HEADS, "tokens": tokens, "head_dim": HEAD_DIM,
                      "dtype": str(dtype).removeprefix("torch."), "kv_bytes": kv_bytes},
            "device": str(placement.device), "recompute_s": round(recompute, 6), "codecs": by_codec,
            "rates": rates, "torch_threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--codecs", default=",".join(CODEC_NAMES), help="comma-separated codecs to measure")
    args = parser.parse_args()
    codecs = tuple(c.strip() for c in args.codecs.split(",") if c.strip())
    if unknown := [c for c in codecs if c not in CODEC_NAMES]:
        parser.error(f"unknown codecs {unknown}: choose from {', '.join(CODEC_NAMES)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(json.dumps(run(args.tokens, args.chunks, args.repeats, args.device, codecs), indent=2))


if __name__ == "__main__":
    main()
