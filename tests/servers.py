"""Real servers on loopback for every test that needs one, in one place.

* redis: :class:`RedisServer` (one ``redis-server`` process on a free
  127.0.0.1 port, without persistence (``--save "" --appendonly no``), in a
  per-test directory, stopped by PID at the end; ``restart()`` brings it back
  on the same port, empty, as after a crash) and :class:`RedisCluster` (a
  real three-master Redis Cluster built by ``redis-cli --cluster create``).
* s3: ``moto_server`` from the venv's bin directory (:func:`run_moto`; the
  ``moto_endpoint`` fixture starts one per test run and stops it by PID),
  and a real Ceph RGW (:class:`RgwServer`: one mon, one memstore OSD and
  radosgw, started once per test run by ``rgw_server``). ``s3_endpoint`` is
  moto; the s3 suites override it with :func:`s3_server_fixture`, which runs
  each test on both servers (ids ``moto`` and ``rgw``; a test marked
  ``moto_only``/``rgw_only`` runs on one). Every test gets its own bucket
  (``bucket``), so tests never see each other's objects. Fake credentials are
  given through the tier config (and the environment, for boto3 clients the
  tests build themselves).

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
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvstore_tiers.tools.children import die_with_parent
from kvstore_tiers.tools.netem import namespaces

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


class WholeOrNothing:
    """A server of several processes: :meth:`start` runs ``_start`` and, if it
    fails or is interrupted, stops what it had started."""

    def _start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def start(self) -> Any:
        try:
            self._start()
        except BaseException:
            self.stop()  # never leave half a cluster running
            raise
        return self


class RedisCluster(WholeOrNothing):
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
def s3_endpoint(moto_endpoint: str) -> str:
    """The S3 server of ``s3``, ``bucket``, ``tier_config`` and ``proxy``: moto,
    unless a test folder or module runs on both (:func:`s3_server_fixture`)."""
    return moto_endpoint


#: The S3 servers a suite of :func:`s3_server_fixture` runs on (its parameter ids).
S3_SERVERS = ("moto", "rgw")


def s3_server_fixture() -> Any:
    """An ``s3_endpoint`` fixture parametrized over moto and Ceph RGW: assign it
    to ``s3_endpoint`` in a conftest.py or test module, and each of its tests
    runs on both (ids ``moto``, ``rgw``; marks ``moto``/``rgw`` select them).
    A test that makes sense on one only says so with ``@pytest.mark.moto_only(
    reason=...)`` or ``rgw_only``; its other run is deselected
    (:func:`deselect_other_server`)."""

    @pytest.fixture(params=[pytest.param(name, marks=getattr(pytest.mark, name))
                            for name in S3_SERVERS])
    def s3_endpoint(request: pytest.FixtureRequest) -> str:
        return str(request.getfixturevalue(f"{request.param}_endpoint"))

    return s3_endpoint


def s3_server_of(item: pytest.Item) -> str | None:
    """The S3 server a collected test runs on (None: not parametrized over one)."""
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("s3_endpoint") if callspec is not None else None


def deselect_other_server(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Drop the runs a ``moto_only``/``rgw_only`` test does not make sense on
    (reported as deselected); such a marker needs ``reason=``."""
    keep, drop = [], []
    for item in items:
        server = s3_server_of(item)
        only = [name for name in S3_SERVERS if item.get_closest_marker(f"{name}_only")]
        for name in only:
            if not item.get_closest_marker(f"{name}_only").kwargs.get("reason"):
                raise pytest.UsageError(f"{item.nodeid}: {name}_only needs reason=...")
        (drop if server is not None and only and server not in only else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture
def s3(s3_endpoint: str) -> Any:
    """A boto3 client on the test's S3 server (to inspect and tamper with objects)."""
    return s3_client(s3_endpoint)


@pytest.fixture
def bucket(s3: Any) -> str:
    """A fresh, empty bucket for this test."""
    name = f"kvt-{uuid.uuid4().hex[:16]}"
    s3.create_bucket(Bucket=name)
    return name


@pytest.fixture
def tier_config(s3_endpoint: str, bucket: str) -> Callable[..., dict[str, Any]]:
    """``tier_config(**overrides)``: an s3 tier dict for this test's bucket."""
    return tier_config_factory(bucket, s3_endpoint, "test/", connect_timeout_s=1.0)


@pytest.fixture
def proxy(s3_endpoint: str) -> Iterator[Any]:
    """A loopback fault proxy in front of the test's S3 server (tests/faults/faultproxy.py)."""
    from tests.faults.faultproxy import FaultProxy

    p = FaultProxy(s3_endpoint)
    yield p
    p.close()


# --------------------------------------------------------------------------- rgw
RGW_BINARIES = ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "monmaptool",
                "ceph-authtool", "ceph")
#: Daemons in start order (stopped in reverse).
_RGW_DAEMONS = ("mon.a", "osd.0", "client.rgw.a")


def need_rgw() -> dict[str, str]:
    """The Ceph binaries by name, or skip the test that needs them."""
    found = {name: shutil.which(name) for name in RGW_BINARIES}
    missing = [name for name, path in found.items() if path is None]
    if missing:  # pragma: no cover - depends on the machine
        pytest.skip(f"Ceph RGW is not installed ({', '.join(missing)} missing: apt-get install "
                    "--no-install-recommends radosgw ceph-mon ceph-osd ceph-common)")
    return {name: str(path) for name, path in found.items()}


class RgwServer(WholeOrNothing):
    """A real S3 server: Ceph RGW 16 on one machine, started and stopped by us.

    One mon (msgr v1 only, on a free low loopback port), one OSD on memstore
    (objects in RAM, 2 GiB at most), no mgr, cephx on (with auth ``none`` the
    OSD's first mon command carries a zero fsid and the OSD fails), pool size 1
    with 8 PGs, and radosgw's beast frontend on 127.0.0.1 (plain http, and
    https with a throw-away CA of :func:`tests.pki.make_pki` when ``tls``).
    Every daemon runs in the foreground as our child, is stopped by its PID and
    dies with the test process. Everything (ceph.conf, keyring, mon store,
    logs) lives in ``workdir``. Start-up takes about 20 s and the daemons hold
    about 350 MB, so a test run starts one (``rgw_server``).

    ``lc_debug_interval_s``: RGW's ``rgw lc debug interval``, the seconds a
    lifecycle "day" lasts (and how often its lifecycle worker runs); -1 for
    real days.

    ``netns``: run every daemon and command inside that network namespace (the
    mon on its loopback), radosgw listening on ``host`` there (its address on
    the namespace's own network: tests/fleet's shared server).
    """

    def __init__(self, workdir: Path, *, tls: bool = True, lc_debug_interval_s: int = 10,
                 access_key: str = FAKE_KEY_ID, secret_key: str = FAKE_SECRET,
                 host: str = "127.0.0.1", netns: str | None = None) -> None:
        self.bin = need_rgw()
        self.host, self.netns = host, netns
        self._in_netns = ["ip", "netns", "exec", netns] if netns else []
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.mon_port = free_low_port()
        self.port = free_low_port(taken={self.mon_port})
        self.tls_port = free_low_port(taken={self.mon_port, self.port}) if tls else None
        self.lc_debug_interval_s = lc_debug_interval_s
        self.access_key, self.secret_key = access_key, secret_key
        self.conf = self.workdir / "ceph.conf"
        self.ca: str | None = None
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def tls_endpoint(self) -> str:
        assert self.tls_port is not None, "started without tls"
        return f"https://{self.host}:{self.tls_port}"

    # -- start ----------------------------------------------------------------
    def _start(self) -> None:
        d = self.workdir
        for sub in ("mon/ceph-a", "osd/ceph-0", "rgw", "run", "log", "tls"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        frontend = f"beast endpoint={self.host}:{self.port}"
        if self.tls_port is not None:
            from tests.pki import make_pki

            pki = make_pki(d / "tls")
            self.ca = pki["ca"]
            frontend += (f" ssl_endpoint={self.host}:{self.tls_port}"
                         f" ssl_certificate={pki['server_cert']}"
                         f" ssl_private_key={pki['server_key']}")
        fsid = str(uuid.uuid4())
        self.conf.write_text(_CEPH_CONF.format(
            fsid=fsid, mon=f"v1:127.0.0.1:{self.mon_port}", d=d, frontend=frontend,
            lc=self.lc_debug_interval_s))
        keyring = d / "keyring"
        self._run(self.bin["monmaptool"], "--create", "--addv", "a",
                  f"[v1:127.0.0.1:{self.mon_port}]", "--fsid", fsid, str(d / "monmap"))
        self._run(self.bin["ceph-authtool"], "--create-keyring", str(keyring), "--gen-key",
                  "-n", "mon.", "--cap", "mon", "allow *")
        for name, caps in _RGW_KEYS.items():
            self._run(self.bin["ceph-authtool"], str(keyring), "--gen-key", "-n", name, *caps)
        # -- mon
        self._run(self.bin["ceph-mon"], "-c", str(self.conf), "--mkfs", "-i", "a",
                  "--monmap", str(d / "monmap"), "--keyring", str(keyring))
        self._spawn("mon.a", self.bin["ceph-mon"], "-i", "a")
        self._wait("the mon", lambda: self._ceph_ok("mon", "stat"), 60)
        # -- osd (memstore)
        osd_uuid = str(uuid.uuid4())
        osd_id = self._ceph("osd", "new", osd_uuid).strip()
        self._run(self.bin["ceph-osd"], "-c", str(self.conf), "-i", osd_id, "--mkfs",
                  "--osd-uuid", osd_uuid)
        self._spawn("osd.0", self.bin["ceph-osd"], "-i", osd_id)
        self._wait("the osd", lambda: " 1 up" in self._ceph("osd", "stat", check=False), 60)
        # -- rgw (creates its pools itself), then an S3 user with our test keys
        self._spawn("client.rgw.a", self.bin["radosgw"], "-n", "client.rgw.a")
        self._wait("radosgw", self._answers, 120)
        self._run(self.bin["radosgw-admin"], "-c", str(self.conf), "-n", "client.admin",
                  "user", "create", "--uid=kvstore", "--display-name=kvstore",
                  f"--access-key={self.access_key}", f"--secret-key={self.secret_key}")

    def _spawn(self, name: str, binary: str, *args: str) -> None:
        log = open(self.workdir / "log" / f"{name}.stderr", "ab")  # noqa: SIM115
        self.procs[name] = subprocess.Popen(
            [*self._in_netns, binary, "-f", "-c", str(self.conf), *args], stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        log.close()

    def _run(self, *cmd: str, timeout: float = 60) -> str:
        res = subprocess.run([*self._in_netns, *cmd], capture_output=True, timeout=timeout,
                             env={**os.environ, "CEPH_CONF": str(self.conf)})
        if res.returncode != 0:
            raise RuntimeError(f"{Path(cmd[0]).name} {' '.join(cmd[1:3])} failed "
                               f"({res.returncode}): {res.stderr.decode(errors='replace')[-2000:]}"
                               f"\n{self.log_tail()}")
        return res.stdout.decode(errors="replace")

    def _ceph(self, *args: str, check: bool = True) -> str:
        cmd = (self.bin["ceph"], "-c", str(self.conf), "--connect-timeout", "5", *args)
        try:
            return self._run(*cmd, timeout=30)
        except (RuntimeError, subprocess.TimeoutExpired):
            if check:
                raise
            return ""

    def _ceph_ok(self, *args: str) -> bool:
        return bool(self._ceph(*args, check=False))

    def _answers(self) -> bool:
        try:
            with namespaces.inside(self.netns):  # the connection is made in the namespace
                answer = urllib.request.urlopen(self.endpoint, timeout=2)
            answer.read()
        except urllib.error.HTTPError:
            return True  # any S3 answer (an error document) means it serves
        except OSError:
            return False
        return True

    def _wait(self, what: str, ready: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited while waiting for {what}:\n"
                                   f"{self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not up within {timeout_s:g}s:\n{self.log_tail()}")
            time.sleep(0.25)  # polling daemon start-up, not a test condition

    # -- use --------------------------------------------------------------------
    def admin(self, *args: str, timeout: float = 120) -> str:
        """``radosgw-admin ARGS`` against this cluster (e.g. ``lc process``)."""
        return self._run(self.bin["radosgw-admin"], "-c", str(self.conf), "-n", "client.admin",
                         *args, timeout=timeout)

    def log_tail(self, chars: int = 1500) -> str:
        """The end of each daemon's log (for a failure's message)."""
        out = []
        for log in sorted((self.workdir / "log").glob("*")):
            text = log.read_text(errors="replace")[-chars:]
            if text.strip():
                out.append(f"--- {log.name}\n{text}")
        return "\n".join(out)

    # -- stop -------------------------------------------------------------------
    def stop(self) -> None:
        """SIGTERM each daemon by PID (rgw, osd, mon), SIGKILL what is left after 10 s."""
        for name in reversed(_RGW_DAEMONS):
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


_RGW_KEYS = {
    "client.admin": ["--cap", "mon", "allow *", "--cap", "osd", "allow *",
                     "--cap", "mgr", "allow *"],
    "osd.0": ["--cap", "mon", "allow profile osd", "--cap", "osd", "allow *",
              "--cap", "mgr", "allow profile osd"],
    "client.rgw.a": ["--cap", "mon", "allow rw", "--cap", "osd", "allow rwx",
                     "--cap", "mgr", "allow rw"],
}

#: One mon (msgr v1), one memstore OSD, pool size 1, 8 PGs, radosgw on loopback;
#: small thread pools (CI has two cores).
_CEPH_CONF = """\
[global]
fsid = {fsid}
mon host = {mon}
mon initial members = a
public addr = 127.0.0.1
cluster addr = 127.0.0.1
public network = 127.0.0.1/32
ms bind ipv6 = false
ms bind msgr2 = false
auth cluster required = cephx
auth service required = cephx
auth client required = cephx
keyring = {d}/keyring
run dir = {d}/run
admin socket = {d}/run/$name.asok
pid file = {d}/run/$name.pid
log file = {d}/log/$name.log
mon data = {d}/mon/$cluster-$id
osd data = {d}/osd/$cluster-$id
osd objectstore = memstore
memstore device bytes = 2147483648
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
osd crush initial weight = 1
mon allow pool size one = true
mon warn on pool no redundancy = false
mon allow pool delete = true
mon osd down out interval = 0
osd op num shards = 1
osd op num threads per shard = 2
ms async op threads = 1
mon compact on start = false
# one bucket-index object per bucket (Ceph 16 makes 11): each test creates a bucket
rgw override bucket index max shards = 1
rgw dynamic resharding = false
# here, not under [client.rgw.a]: `radosgw-admin lc process` must count days alike
rgw lc debug interval = {lc}
[client.rgw.a]
rgw frontends = {frontend}
rgw data = {d}/rgw
rgw thread pool size = 32
rgw enable usage log = false
"""


@pytest.fixture(scope="session")
def rgw_server(request: pytest.FixtureRequest) -> Iterator[RgwServer]:
    """One RGW for the test run (about 20 s to start, 350 MB), stopped by PID at
    its end; its directory (logs included) is kept, and named, when start-up or
    a test of the run failed."""
    pytest.importorskip("boto3")
    srv = RgwServer(Path(tempfile.mkdtemp(prefix="kvt-rgw-")))
    keep = True
    try:
        srv.start()
        yield srv
        keep = request.session.testsfailed > 0
    finally:
        srv.stop()
        if keep:  # through the terminal reporter: output capture would swallow a print
            said = f"RGW directory (logs) kept: {srv.workdir}"
            reporter = request.config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                reporter.write_line(said, yellow=True)
            else:
                print(said, file=sys.stderr)
        else:
            shutil.rmtree(srv.workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def rgw_endpoint(rgw_server: RgwServer) -> str:
    return rgw_server.endpoint
