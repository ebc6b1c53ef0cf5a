"""Helpers for tests and benchmarks: a throwaway local redis-server and random ChunkKVs."""
from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time

import redis
import torch

from blend.chunk_kv import ChunkKV, hash_ids
from store.keys import kv_key


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """`redis-server` on 127.0.0.1 without persistence; stop() kills it like a crash, and
    start() brings it back (empty) on the same port."""

    def __init__(self, port: int | None = None, password: str | None = None) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise FileNotFoundError("redis-server not found (apt-get install redis-server)")
        self.port = port or free_port()
        self.password = password
        self._dir = tempfile.TemporaryDirectory(prefix="ragblend-redis-")
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=1.0)

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", self._dir.name]
        if self.password:
            args += ["--requirepass", self.password]
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        with self.client() as client:
            while True:
                if self._proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self._proc.returncode} (port {self.port} taken?)")
                try:
                    client.ping()
                    return self
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        self.stop()
                        raise TimeoutError(f"redis-server on port {self.port} did not answer PING") from None
                    time.sleep(0.02)

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections hang until they time out."""
        self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._dir.cleanup()


def random_kv(seed: int, shape: tuple[int, int, int, int] = (4, 3, 17, 8), fingerprint: str = "model-a",
              context: list[int] | None = None, dtype: torch.dtype = torch.float32) -> tuple[str, ChunkKV]:
    """(key, kv): a random chunk KV of shape [L, H, T, D] under its own key."""
    g = torch.Generator().manual_seed(seed)
    L, H, T, D = shape
    keys = torch.randn(L, H, T, D, generator=g)  # [L, H, T, D]
    keys[..., 0] *= 20  # an outlier channel, as real keys have
    values = torch.randn(L, H, T, D, generator=g)  # [L, H, T, D]
    token_ids = torch.randint(0, 49152, (T,), generator=g)
    kv = ChunkKV(keys.to(dtype), values.to(dtype), token_ids, position=len(context or []),
                 context_hash=hash_ids(context or []), fingerprint=fingerprint)
    return kv_key(fingerprint, kv.context_hash, token_ids), kv


def assert_same_kv(got: ChunkKV, want: ChunkKV, codec: str = "fp16") -> None:
    """`got` is `want` after a round trip through `codec`: fp16 bit-exact, int8 within scale/2."""
    assert torch.equal(got.token_ids, want.token_ids)
    assert (got.position, got.context_hash, got.fingerprint) == (want.position, want.context_hash, want.fingerprint)
    if codec == "fp16":
        assert got.keys.dtype == torch.float16
        assert torch.equal(got.keys, want.keys.half()) and torch.equal(got.values, want.values.half())
        return
    assert got.keys.dtype == torch.float32
    for x, y, dim in ((want.keys, got.keys, 2), (want.values, got.values, 3)):  # K per channel, V per token
        x = x.float()
        half_step = x.abs().amax(dim=dim, keepdim=True) / 127 / 2
        assert ((x - y).abs() <= half_step * (1 + 1e-4)).all()
