"""Real redis-server processes for the redis tier tests.

Every server listens on 127.0.0.1 on a free port, without persistence
(``--save "" --appendonly no``), in a per-test temporary directory, and is
stopped by PID at the end of the test. ``RedisServer.restart()`` brings a
server back on the same port (empty: there is no persistence), as after a
crash. ``redis_cluster`` builds a real three-master Redis Cluster.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")

if REDIS_SERVER is None:  # pragma: no cover - depends on the machine
    pytest.skip("redis-server is not installed (apt-get install redis-server)",
                allow_module_level=True)


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_cluster_port() -> int:
    """A free port P <= 55535 whose cluster bus port P+10000 is free too."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 45000)
        if _port_free(port) and _port_free(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


class RedisServer:
    """One redis-server process. ``args`` are extra command-line options."""

    def __init__(self, workdir: Path, args: list[str] | None = None, port: int | None = None,
                 tls: dict[str, str] | None = None) -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.args = list(args or [])
        self.port = port or free_port()
        self.tls = tls  # client kwargs for a TLS-only server (then PING goes over TLS)
        self.proc: subprocess.Popen[bytes] | None = None
        self.password: str | None = None
        if "--requirepass" in self.args:
            self.password = self.args[self.args.index("--requirepass") + 1]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        """A plain admin client (not the tier's)."""
        kw: dict[str, Any] = {"socket_timeout": 5, "password": self.password}
        if self.tls:
            kw.update(ssl=True, **self.tls)
        return redis.Redis(host="127.0.0.1", port=self.port, **kw)

    def start(self) -> RedisServer:
        port_args = ["--port", str(self.port)]
        if self.tls:
            port_args = ["--port", "0", "--tls-port", str(self.port)]
        cmd = [REDIS_SERVER, *port_args, "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no", "--dir", str(self.workdir), "--daemonize", "no",
               *self.args]
        log = open(self.workdir / f"redis-{self.port}.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.wait_ready()
        return self

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Wait until the server answers PING (it takes a few ms to start)."""
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {self.log_tail()}")
            try:
                with self.client() as c:
                    if c.ping():
                        return
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis-server not ready: {self.log_tail()}")
            time.sleep(0.01)

    def log_tail(self) -> str:
        path = self.workdir / f"redis-{self.port}.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def kill(self) -> None:
        """SIGKILL (a crash), and wait for the process to be gone."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.proc = None

    def restart(self) -> None:
        """Start again on the same port (empty dataset)."""
        self.kill()
        self.start()


@pytest.fixture
def redis_server_factory(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """Start redis-servers with extra args; all are stopped at the end of the test."""
    started: list[RedisServer] = []

    def make(args: list[str] | None = None, **kw: Any) -> RedisServer:
        srv = RedisServer(tmp_path / f"redis{len(started)}", args, **kw)
        started.append(srv)
        return srv.start()

    yield make
    for srv in started:
        srv.stop()


@pytest.fixture
def redis_server(redis_server_factory: Callable[..., RedisServer]) -> RedisServer:
    """A plain server with allkeys-lru (what the docs recommend)."""
    return redis_server_factory(["--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru"])


class RedisCluster:
    """Three masters on loopback, slots split by ``redis-cli --cluster create``."""

    def __init__(self, workdir: Path) -> None:
        self.nodes = [
            RedisServer(workdir / f"node{i}", [
                "--cluster-enabled", "yes",
                "--cluster-config-file", f"nodes-{i}.conf",
                "--cluster-node-timeout", "1000",
                # Keep serving the healthy nodes' slots when one master is down
                # (what a replica-less cache cluster wants; see docs/redis.md).
                "--cluster-require-full-coverage", "no",
            ], port=free_cluster_port())
            for i in range(3)
        ]

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{n.port}" for n in self.nodes]

    def start(self) -> RedisCluster:
        try:
            self._start()
        except BaseException:
            self.stop()  # never leave half a cluster running
            raise
        return self

    def _start(self) -> None:
        for n in self.nodes:
            n.start()
        assert REDIS_CLI is not None
        subprocess.run(
            [REDIS_CLI, "--cluster", "create", *self.addresses, "--cluster-replicas", "0",
             "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )
        deadline = time.monotonic() + 30
        for n in self.nodes:
            with n.client() as c:
                while b"cluster_state:ok" not in c.execute_command("CLUSTER", "INFO"):
                    if time.monotonic() > deadline:
                        raise TimeoutError("cluster did not reach state ok")
                    time.sleep(0.05)

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[RedisCluster]:
    cluster = RedisCluster(tmp_path / "cluster").start()
    yield cluster
    cluster.stop()


def random_rows(n: int, row_bytes: int, seed: int = 0) -> np.ndarray:
    """``n`` rows of random bytes (incompressible: exercises raw frames)."""
    return np.random.default_rng(seed).integers(0, 256, (n, row_bytes), dtype=np.uint8)
