"""Real servers for tests and benchmarks on loopback ports taken without a race: redis-server and
PostgreSQL, and `listening_port` for a server started on port 0.

A port found free is not necessarily free when the server binds it (another process may take it in
between), so redis-server and PostgreSQL, which need a port given, start again on another when they
find theirs taken; a server that binds port 0 itself gets one no other process holds."""
from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
import redis

PORT_ATTEMPTS = 5  # ports found free and then taken this many times running: not a race, a fault


class PortTaken(RuntimeError):
    """The server could not bind its port: another process holds it."""


def free_port() -> int:
    """A port free now: for a server that starts again on another when it finds this one taken."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening_port(proc: subprocess.Popen, timeout_s: float = 300.0) -> int:
    """The TCP port `proc` listens on, once it does (a server started on port 0 binds one itself)."""
    process = psutil.Process(proc.pid)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"process {proc.pid} exited with {proc.returncode} before it listened")
        ports = [c.laddr.port for c in process.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
        if ports:
            return ports[0]
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {proc.pid} did not listen within {timeout_s:.0f} s")
        time.sleep(0.1)


def start_on_free_port(server, start_once) -> None:
    """`start_once()`; while it raises PortTaken on a port we chose, again on another (bounded).
    A port given, or one the server already ran on (a restart), is kept: that is the caller's."""
    for attempt in range(PORT_ATTEMPTS):
        try:
            start_once()
            server.chosen_port = False  # a restart keeps it: clients hold its URL
            return
        except PortTaken:
            if not server.chosen_port or attempt == PORT_ATTEMPTS - 1:
                raise
            server.port = free_port()


class RedisServer:
    """`redis-server` on 127.0.0.1 without persistence; stop() kills it like a crash, and
    start() brings it back (empty) on the same port."""

    def __init__(self, port: int | None = None, password: str | None = None, maxmemory: str | None = None,
                 policy: str = "allkeys-lru") -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise FileNotFoundError("redis-server not found (apt-get install redis-server)")
        self.port, self.chosen_port = port or free_port(), port is None
        self.password = password
        self.maxmemory, self.policy = maxmemory, policy  # e.g. "4mb": evicts by `policy` past it
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
        start_on_free_port(self, lambda: self._start_once(timeout_s))
        return self

    def _start_once(self, timeout_s: float) -> None:
        log = Path(self._dir.name) / "redis.log"
        log.unlink(missing_ok=True)
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", self._dir.name, "--logfile", str(log)]
        if self.password:
            args += ["--requirepass", self.password]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", self.policy]
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        with self.client() as client:
            while True:
                if self._proc.poll() is not None:
                    code, self._proc = self._proc.returncode, None
                    tail = log.read_text()[-1000:] if log.exists() else ""
                    error = PortTaken if "already in use" in tail else RuntimeError
                    raise error(f"redis-server on port {self.port} exited with {code}: {tail}")
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"redis-server on port {self.port} did not answer INFO")
                try:  # ours, not another server holding the port ours then fails to bind
                    if client.info("server")["process_id"] == self._proc.pid:
                        return
                except redis.RedisError:  # not up yet, or not ours
                    pass
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


def postgres_bin() -> Path | None:
    """The folder of initdb/pg_ctl: on the PATH, else Debian's /usr/lib/postgresql/<newest>/bin."""
    if found := shutil.which("initdb"):
        return Path(found).parent
    folders = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name))
    return Path(folders[-1]) if folders else None


class PostgresServer:
    """A throwaway PostgreSQL cluster (initdb in a temp dir) on 127.0.0.1, trust auth, user
    `postgres`; fsync off (a test needs no durability against power loss, only against a killed
    client). initdb and postgres refuse to run as root, so as root (CI) they run as `nobody`.
    `database()` makes a fresh database per test."""

    USER = "postgres"

    def __init__(self, port: int | None = None) -> None:
        self.bin = postgres_bin()
        if self.bin is None:
            raise FileNotFoundError("PostgreSQL not found (apt-get install postgresql)")
        self.port, self.chosen_port = port or free_port(), port is None
        self.dir = Path(tempfile.mkdtemp(prefix="ragblend-pg-"))
        self._as_user: list[str] = []
        if os.geteuid() == 0:
            shutil.chown(self.dir, "nobody")
            self._as_user = ["runuser", "-u", "nobody", "--"]
        self._databases = 0

    @property
    def data(self) -> Path:
        return self.dir / "data"

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://{self.USER}@127.0.0.1:{self.port}/{dbname}"

    def _run(self, tool: str, *args: str) -> None:
        result = subprocess.run([*self._as_user, str(self.bin / tool), *args], capture_output=True, text=True)
        if result.returncode:
            log = (self.dir / "log").read_text() if (self.dir / "log").exists() else ""
            error = PortTaken if "already in use" in log else RuntimeError
            raise error(f"{tool} failed ({result.returncode}): {result.stderr.strip()} {log[-2000:]}")

    def start(self) -> PostgresServer:
        if not self.data.exists():
            self._run("initdb", "-D", str(self.data), "-U", self.USER, "--auth=trust", "-E", "UTF8", "--no-sync")
        start_on_free_port(self, self._start_once)
        return self

    def _start_once(self) -> None:
        (self.dir / "log").unlink(missing_ok=True)  # this attempt's messages only
        options = (f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off "
                   f"-c synchronous_commit=off -c full_page_writes=off")
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.dir / "log"), "-w", "-t", "60",
                  "start")

    def database(self) -> str:
        """The URL of a new, empty database."""
        import psycopg

        self._databases += 1
        name = f"test_{self._databases}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
