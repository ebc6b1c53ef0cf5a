"""Real servers for tests and benchmarks, started on free loopback ports: redis-server."""
from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time

import redis


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
