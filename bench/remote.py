"""TTFT with the chunks' KV in a Redis tier behind a throttled link (simulated), per codec, vs full prefill.

One run on one MuSiQue question (default 10 passages, ~5.5k tokens) with SmolLM2 prints JSON:
    {"prompt_tokens", "link_mbit_s", "full_prefill_s",
     "codecs": {codec: {"kv_mb", "ttft_s": {"fixed", "auto"}, "vs_full": {"fixed", "auto"}, "controller"}},
     "auto_never_slower_than_full", "calibration", "commit", "loadavg_before", "loadavg_after", ...}

The link is simulated: `ThrottledLink`, a TCP proxy in this process between the store's Redis client and a
local redis-server (tests.servers.RedisServer), passes at most --throttle-mbit megabits a second each way,
shared by every connection (the store's read threads share one link). Nothing else about a network
(latency, loss) is modelled. Each codec gets its own store (the one Redis tier, that codec; cachegen with
this model's tables, fitted on the shipped sample as serving fits them: app/cachegen.py), every passage's
KV stored through the link beforehand (as ingest does).

TTFT = open the stored entries + blended prefill + the first token:
- "fixed": blend.ratio --ratio (default 0.15), loading pipelined (blend.pipeline);
- "auto": blend.ratio: auto, the loading controller as serving runs it (app.engine.loading.LoadingControl): the ratio
  (>= --ratio) and, per chunk, load or recompute from text, from the compute cost, link bandwidth and codec
  decode rate measured on a first, untimed prefill of the same store (and on each timed one after it);
- "full prefill": every token through the model, no store (the reference; timed once per repeat).
vs_full = TTFT / full prefill's, medians over interleaved repeats.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from app.cachegen import tier_codecs  # noqa: E402
from app.components import Components  # noqa: E402
from app.config import load_settings  # noqa: E402
from app.engine.loading import LoadingControl  # noqa: E402
from blend import ChunkKV  # noqa: E402
from blend.pipeline import LayerSource  # noqa: E402
from common import git_commit  # noqa: E402
from store import CODEC_NAMES, RedisTier, StoreSettings, TieredStore  # noqa: E402
from tests.servers import RedisServer  # noqa: E402

CHUNK = 64 << 10  # bytes a pump passes at a time


class ThrottledLink:
    """A TCP proxy on 127.0.0.1 to `target` passing at most `bits_per_s` each way, all connections together
    (one link: a byte waits for every byte sent before it the same way). Benchmark-only."""

    def __init__(self, target: tuple[str, int], bits_per_s: float) -> None:
        self._target, self._bytes_per_s = target, bits_per_s / 8
        self._free_at = {"up": 0.0, "down": 0.0}  # when the link is next idle, each way
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True, name="link-accept").start()

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
                upstream = socket.create_connection(self._target)
            except OSError:
                return  # closed
            with self._lock:
                self._sockets += [client, upstream]
            for src, dst, way in ((client, upstream, "up"), (upstream, client, "down")):
                threading.Thread(target=self._pump, args=(src, dst, way), daemon=True, name=f"link-{way}").start()

    def _pump(self, src: socket.socket, dst: socket.socket, way: str) -> None:
        try:
            while data := src.recv(CHUNK):
                self._wait_for_link(way, len(data))
                dst.sendall(data)
        except OSError:
            pass
        finally:  # one side gone: end both
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def _wait_for_link(self, way: str, nbytes: int) -> None:
        """Sleep until `nbytes` have crossed the link after everything queued before them."""
        with self._lock:
            done = max(time.perf_counter(), self._free_at[way]) + nbytes / self._bytes_per_s
            self._free_at[way] = done
        time.sleep(max(0.0, done - time.perf_counter()))

    def close(self) -> None:
        self._server.close()
        with self._lock:
            for s in self._sockets:
                s.close()


@dataclass
class Piece:
    """A passage as the engine's plan holds it (app.engine.loading.Piece)."""

    ids: list[int]
    tier: str | None
    kv: ChunkKV | LayerSource | None


def drive(steps):
    """Run a generator of steps (the engine yields between slices) to its end; what it returns."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", type=Path, default=REPO.parent / "shared/data/musique_dev.json")
    parser.add_argument("--question", type=int, default=0)
    parser.add_argument("--passages", type=int, default=10)
    parser.add_argument("--ratio", type=float, default=0.15, help="the fixed ratio, and auto's floor")
    parser.add_argument("--codecs", default="fp16,int4,cachegen")
    parser.add_argument("--throttle-mbit", type=float, default=1000.0, help="the simulated link, Mbit/s each way")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    codecs = args.codecs.split(",")
    if unknown := [c for c in codecs if c not in CODEC_NAMES]:
        parser.error(f"unknown codecs {unknown}: choose from {list(CODEC_NAMES)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    item = json.loads(args.dataset.read_text())[args.question]
    load_before, commit = os.getloadavg(), git_commit()  # the checkout the run started from

    with tempfile.TemporaryDirectory() as tmp, RedisServer() as redis_server, contextlib.ExitStack() as closing:
        link = ThrottledLink(("127.0.0.1", redis_server.port), args.throttle_mbit * 1e6)
        closing.callback(link.close)
        settings = load_settings(data_dir=tmp, model={"cache_dir": str(REPO / "data/models")},
                                 store={"memory_bytes": 0, "disk_bytes": 0})
        parts = Components(settings)
        closing.callback(parts.close)
        blender, kv_cache = parts.blender, parts.kv_cache
        head = kv_cache.head()
        suffix = kv_cache.prompt.suffix_ids(item["question"])
        passages = [kv_cache.prompt.text_passage_ids(c["text"], c["title"]) for c in item["ctxs"][:args.passages]]
        full_ids = [*kv_cache.context_ids, *(t for p in passages for t in p), *suffix]
        log(f"precomputing {len(passages)} passages ({len(full_ids)} prompt tokens)")
        kvs = [blender.precompute(ids, kv_cache.context_ids, context=head) for ids in passages]
        keys = [kv_cache.key(ids) for ids in passages]

        stores, controls = {}, {}
        for db, name in enumerate(codecs):  # one Redis database per codec: the same keys, apart
            (codec,) = tier_codecs(StoreSettings(codec=name), Path(tmp), blender, kv_cache.prompt,
                                   tiers=["redis"]).values()
            store = closing.enter_context(TieredStore([RedisTier(link.url(db), timeout_s=60.0)], codec=codec,
                                                      fingerprint=blender.fingerprint,
                                                      placement=blender.backend.placement))
            log(f"storing the passages as {name} through the link")
            for key, kv in zip(keys, kvs):
                store.put(key, kv)
            store.flush()
            stores[name], controls[name] = store, LoadingControl(blender, store, floor=args.ratio)

        def recompute(piece: Piece) -> ChunkKV:  # what app.engine.kv.ChunkKVCache.compute does
            return blender.precompute(piece.ids, kv_cache.context_ids, context=head)

        def blended(name: str, how: str) -> tuple[float, dict | None]:
            """TTFT from `name`'s store, at the fixed ratio or the controller's; and the controller's decision."""
            store, control = stores[name], controls[name]
            start = time.perf_counter()
            pieces = [Piece(ids, "redis", store.open(key)) for ids, key in zip(passages, keys)]
            ratio, decision = args.ratio, None
            try:
                if how == "auto":  # the controller may recompute some passages from text here
                    ratio, decision = drive(control.ratio(pieces, len(suffix), None, recompute))
                compute_start = time.perf_counter()
                prefill = blender.prefill([head, *(p.kv for p in pieces)], suffix, ratio, pipeline=True,
                                          recompute=lambda i: recompute(pieces[i - 1]))
                int(prefill.logits.argmax())
            finally:
                for p in pieces:
                    if not isinstance(p.kv, ChunkKV):
                        p.kv.close()
            end = time.perf_counter()
            tokens = (prefill.stats.recomputed_tokens + len(suffix)) * blender.num_layers
            control.observe(tokens, end - compute_start - prefill.stats.load_wait_ms / 1e3)
            return end - start, decision

        def full() -> float:
            start = time.perf_counter()
            int(blender.full_prefill(full_ids).logits.argmax())
            return time.perf_counter() - start

        for name in codecs:  # warm-up: the controller's first measurements
            log(f"calibrating on {name}")
            blended(name, "fixed")
        times: dict[tuple[str, str], list[float]] = {}
        plans: dict[str, dict] = {}
        for r in range(args.repeats):
            times.setdefault(("full", "prefill"), []).append(full())
            log(f"repeat {r + 1}/{args.repeats}: full prefill {times['full', 'prefill'][-1]:.2f}s")
            for name in codecs:  # interleaved, so noise hits every case alike
                for how in ("fixed", "auto"):
                    seconds, decision = blended(name, how)
                    times.setdefault((name, how), []).append(seconds)
                    if decision is not None:
                        plans[name] = decision
                    log(f"repeat {r + 1}/{args.repeats} {name:>8} {how:>5}: {seconds:.2f}s")
        with contextlib.ExitStack() as opened:
            kv_mb = {name: sum(opened.enter_context(stores[name].open(k)).nbytes for k in keys) / 1e6
                     for name in codecs}

    median = {run: statistics.median(t) for run, t in times.items()}
    full_s = median["full", "prefill"]
    print(json.dumps({
        "simulated_link": "simulated: a TCP proxy in the bench process throttles each direction (bench/remote.py)",
        "link_mbit_s": args.throttle_mbit, "passages": len(passages), "prompt_tokens": len(full_ids),
        "ratio": args.ratio, "repeats": args.repeats, "full_prefill_s": round(full_s, 3),
        "codecs": {name: {"kv_mb": round(kv_mb[name], 2),
                          "ttft_s": {how: round(median[name, how], 3) for how in ("fixed", "auto")},
                          "vs_full": {how: round(median[name, how] / full_s, 3) for how in ("fixed", "auto")},
                          "controller": plans.get(name)} for name in codecs},
        "auto_never_slower_than_full": all(median[name, "auto"] <= full_s for name in codecs),
        "threads": torch.get_num_threads(), "commit": commit,
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }, indent=2))


if __name__ == "__main__":
    main()
