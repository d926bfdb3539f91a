"""Real servers on loopback for every test that needs one, in one place.

* redis: :class:`RedisServer` (one ``redis-server`` process on a free
  127.0.0.1 port, without persistence (``--save "" --appendonly no``), in a
  per-test directory, stopped by PID at the end; ``restart()`` brings it back
  on the same port, empty, as after a crash) and :class:`RedisCluster` (a
  real three-master Redis Cluster built by ``redis-cli --cluster create``).
* s3: ``moto_server`` from the venv's bin directory (:func:`run_moto`; the
  ``moto_endpoint`` fixture starts one per test run and stops it by PID);
  every test gets its own bucket (``bucket``), so tests never see each
  other's objects. Fake credentials are given through the tier config (and
  the environment, for boto3 clients the tests build themselves).

``tests/conftest.py`` makes the fixtures below available to every test
folder; the classes and helpers are imported from here.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

# ------------------------------------------------------------------------- redis
REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")



def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def need_redis_server() -> str:
    """The redis-server binary, or skip the test that needs it."""
    if REDIS_SERVER is None:  # pragma: no cover - depends on the machine
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    return REDIS_SERVER


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ephemeral_low() -> int:
    """The first port the kernel hands out to outgoing connections."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):  # pragma: no cover - not Linux
        return 32768


#: A cluster node's bus port is its port + this (Redis's rule).
CLUSTER_BUS = 10000


def free_low_port(span: int = 0, taken: Collection[int] = ()) -> int:
    """A free 127.0.0.1 port P, not in ``taken``, with P + ``span`` (a cluster
    node's bus port) free and not in ``taken`` too.

    Both lie below the kernel's ephemeral range where it starts at 12000 +
    ``span`` or above (Linux's default is 32768), so no client connection of
    this test run can take either between this check and the server's bind.
    """
    rng = random.Random()
    top = max(_ephemeral_low() - span, 12000)
    for _ in range(200):
        port = rng.randrange(10000, top)
        ports = {port, port + span}
        if not ports & set(taken) and all(_port_free(p) for p in ports):
            return port
    raise RuntimeError("no free port below the ephemeral range")


#: redis-server's line when its TCP or TLS port (or a cluster bus port) is taken.
_BIND_FAILED = re.compile(r"Could not create server \w+ listening socket .*Address already in use")


class RedisServer:
    """One redis-server process. ``args`` are extra command-line options."""

    def __init__(self, workdir: Path, args: list[str] | None = None, port: int | None = None,
                 tls: dict[str, str] | None = None,
                 pick_port: Callable[[], int] = free_low_port) -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.args = list(args or [])
        # A port we picked may be taken between the pick and the server's bind
        # (by any other process); then the first start picks again.
        self._pick_port = None if port else pick_port
        self.port = port or pick_port()
        self.tls = tls  # client kwargs for a TLS-only server (then PING goes over TLS)
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_from = 0  # where the last start's lines begin in its log
        self.password: str | None = None
        if "--requirepass" in self.args:
            self.password = self.args[self.args.index("--requirepass") + 1]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, probe: bool = False) -> redis.Redis:
        """A plain admin client (not the tier's); ``probe``: one short try."""
        kw: dict[str, Any] = {"socket_timeout": 5, "password": self.password}
        if probe:  # whatever else holds the port may never answer
            kw.update(socket_timeout=0.5, retry=Retry(NoBackoff(), 0))
        if self.tls:
            kw.update(ssl=True, **self.tls)
        return redis.Redis(host="127.0.0.1", port=self.port, **kw)

    def start(self) -> RedisServer:
        for _ in range(5):
            try:
                return self._start_once()
            except (RuntimeError, TimeoutError):
                self.kill()
                tail = self._attempt_log()[-2000:]
                if self._pick_port is None or not _BIND_FAILED.search(tail):
                    raise
                self.port = self._pick_port()
        raise RuntimeError(f"redis-server found no free port; its last try: {tail}")

    def _start_once(self) -> RedisServer:
        port_args = ["--port", str(self.port)]
        if self.tls:
            port_args = ["--port", "0", "--tls-port", str(self.port)]
        cmd = [need_redis_server(), *port_args, "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no", "--dir", str(self.workdir), "--daemonize", "no",
               *self.args]
        path = self._log_path()
        self._log_from = path.stat().st_size if path.exists() else 0
        log = open(path, "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.wait_ready()
        self._pick_port = None  # a restart comes back on this port
        return self

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Wait until this process answers PING (it takes a few ms to start).

        Another server that holds the port may answer first: the PID tells them
        apart, and this process then exits, unable to bind."""
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {self.log_tail()}")
            try:
                with self.client(probe=True) as c:
                    if c.ping() and c.info("server")["process_id"] == self.proc.pid:
                        return
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis-server not ready: {self.log_tail()}")
            time.sleep(0.01)

    def _log_path(self) -> Path:
        return self.workdir / f"redis-{self.port}.log"

    def _attempt_log(self) -> str:
        """What the last start wrote to its log."""
        path = self._log_path()
        if not path.exists():
            return ""
        with path.open("rb") as f:
            f.seek(self._log_from)
            return f.read().decode(errors="replace")

    def log_tail(self) -> str:
        path = self._log_path()
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
        chosen: set[int] = set()

        def pick() -> int:  # three nodes: six distinct ports, bus ports included
            port = free_low_port(CLUSTER_BUS, chosen)
            chosen.update((port, port + CLUSTER_BUS))
            return port

        self.nodes = [
            RedisServer(workdir / f"node{i}", [
                "--cluster-enabled", "yes",
                "--cluster-config-file", f"nodes-{i}.conf",
                "--cluster-node-timeout", "1000",
                # Keep serving the healthy nodes' slots when one master is down
                # (what a replica-less cache cluster wants; see docs/redis.md).
                "--cluster-require-full-coverage", "no",
            ], pick_port=pick)
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
        if REDIS_CLI is None:  # pragma: no cover - depends on the machine
            pytest.skip("redis-cli is not installed (apt-get install redis-tools)")
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


# ---------------------------------------------------------------------------- s3
FAKE_KEY_ID = "AKIATESTFAKEKEYID001"
FAKE_SECRET = "fakeSecretAccessKey/DoNotLog+42"


def moto_server_bin() -> str:
    path = Path(sys.executable).parent / "moto_server"
    if not path.exists():
        pytest.skip("moto_server is not installed in this environment")
    return str(path)


def _start_moto(env: dict[str, str] | None, tls: tuple[str, str, str] | None,
                ctx: ssl.SSLContext | None) -> tuple[subprocess.Popen[bytes] | None, str]:
    """moto_server on a port free a moment ago, once it answers; (None, url)
    if that port was taken before moto could bind it. Any other early exit
    raises with moto's own words."""
    port = free_low_port()
    args = [moto_server_bin(), "-H", "127.0.0.1", "-p", str(port)]
    if tls is not None:
        args += ["-c", tls[0], "-k", tls[1]]
    url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=err,
                                env={**os.environ, **(env or {})})
        try:
            deadline = time.monotonic() + 30
            while proc.poll() is None:
                try:
                    urllib.request.urlopen(f"{url}/moto-api/data.json", timeout=1,
                                           context=ctx).read()
                    return proc, url
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError("moto_server did not answer within 30s") from None
                    time.sleep(0.1)  # polling for server start-up, not a test condition
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        err.seek(0)
        said = err.read().decode(errors="replace")
    if "is in use by another program" in said:  # werkzeug's words for EADDRINUSE
        return None, url
    raise RuntimeError(f"moto_server exited with {proc.returncode}: {said[-2000:]}")


@contextlib.contextmanager
def run_moto(env: dict[str, str] | None = None, *,
             tls: tuple[str, str, str] | None = None) -> Iterator[str]:
    """Start moto_server on a free port; yield its URL; stop it by PID.

    ``tls=(cert, key, ca)``: serve https with that certificate (the start-up
    probe trusts ``ca``).
    """
    ctx = None
    if tls is not None:
        ctx = ssl.create_default_context(cafile=tls[2])
    for _ in range(5):  # a port taken between the pick and moto's bind: pick again
        proc, url = _start_moto(env, tls, ctx)
        if proc is not None:
            break
    else:
        raise RuntimeError("moto_server found every picked port taken, five times")
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    pytest.importorskip("aiobotocore")
    pytest.importorskip("moto")
    with run_moto() as url:
        yield url


@pytest.fixture(autouse=True)
def _fake_aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test: never pick up a developer's real AWS profile or keys."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", FAKE_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", FAKE_SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")


def s3_client(endpoint: str, verify: str | None = None) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", verify=verify,
                        aws_access_key_id=FAKE_KEY_ID, aws_secret_access_key=FAKE_SECRET)


def tier_config_factory(bucket: str, endpoint: str, prefix: str,
                        connect_timeout_s: float) -> Callable[..., dict[str, Any]]:
    """``make(**overrides)``: an s3 tier dict for ``bucket`` on ``endpoint``."""

    def make(**overrides: Any) -> dict[str, Any]:
        return {
            "type": "s3", "bucket": bucket, "prefix": prefix, "endpoint_url": endpoint,
            "aws_access_key_id": FAKE_KEY_ID, "aws_secret_access_key": FAKE_SECRET,
            "connect_timeout_s": connect_timeout_s, "read_timeout_s": 5.0, **overrides,
        }

    return make


@pytest.fixture
def s3(moto_endpoint: str) -> Any:
    """A boto3 client on the moto server (to inspect and tamper with objects)."""
    return s3_client(moto_endpoint)


@pytest.fixture
def bucket(s3: Any) -> str:
    """A fresh, empty bucket for this test."""
    name = f"kvt-{uuid.uuid4().hex[:16]}"
    s3.create_bucket(Bucket=name)
    return name


@pytest.fixture
def tier_config(moto_endpoint: str, bucket: str) -> Callable[..., dict[str, Any]]:
    """``tier_config(**overrides)``: an s3 tier dict for this test's bucket."""
    return tier_config_factory(bucket, moto_endpoint, "test/", connect_timeout_s=1.0)


@pytest.fixture
def proxy(moto_endpoint: str) -> Iterator[Any]:
    """A loopback fault proxy in front of the moto server (tests/faults/faultproxy.py)."""
    from tests.faults.faultproxy import FaultProxy

    p = FaultProxy(moto_endpoint)
    yield p
    p.close()
