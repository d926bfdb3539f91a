"""The shared tier's server, run inside a :class:`tests.netns.Fabric`'s server namespace.

A test takes a :class:`SharedServer` as a parameter, so the server behind the
hosts is swapped without touching the test: each one starts its process in
the server namespace (stopped by PID with the fabric), waits until a host can
reach it, and gives the tier keys a host needs to use it. Everything listens
on the fabric's server address only, which nothing outside the fabric routes
to.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, Protocol

from tests.netns import Fabric
from tests.servers import (
    FAKE_KEY_ID,
    FAKE_SECRET,
    RgwServer,
    moto_server_bin,
    need_redis_server,
)


class SharedServer(Protocol):
    """One server every host of a fabric shares."""

    name: str

    def start(self, fabric: Fabric, workdir: Path, reach_from: str) -> None:
        """Start in ``fabric.server_ns``; return once ``reach_from`` (a host's
        namespace) can connect."""

    def tier(self, fabric: Fabric) -> dict[str, Any]:
        """The tier config a host uses it with: the server's keys, its timeouts,
        and ``load_timeout_s``, a deadline the server meets when it is healthy."""


class SharedRedis:
    """One redis-server on the server address (allkeys-lru, no persistence)."""

    name = "redis"
    port = 6379  # the namespace is the fabric's own: no other process can hold it

    def start(self, fabric: Fabric, workdir: Path, reach_from: str) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        log = open(workdir / "redis.log", "wb")  # noqa: SIM115 - the child holds it
        fabric.spawn(fabric.server_ns, [
            need_redis_server(), "--bind", fabric.server_address, "--port", str(self.port),
            # protected mode refuses clients not on loopback without a password;
            # the fabric's hosts are on its own bridge, reachable from nowhere else
            "--protected-mode", "no", "--save", "", "--appendonly", "no",
            "--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru",
            "--dir", str(workdir), "--daemonize", "no"], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        fabric.wait_tcp(reach_from, fabric.server_address, self.port)

    def tier(self, fabric: Fabric) -> dict[str, Any]:
        return {"type": "redis", "url": f"redis://{fabric.server_address}:{self.port}/0",
                "socket_timeout_s": 1.0, "connect_timeout_s": 0.5, "load_timeout_s": 1.0}


class _SharedS3:
    """An S3 server on the server address, with the bucket the hosts use."""

    name: str
    port: int
    bucket = "kv-fleet"

    def _endpoint(self, fabric: Fabric) -> str:
        return f"http://{fabric.server_address}:{self.port}"

    def _make_bucket(self, fabric: Fabric, reach_from: str) -> None:
        # Created once here, not by each host's create_bucket (they would race).
        make = ("import boto3, sys; boto3.client('s3', endpoint_url=sys.argv[1], "
                "region_name='us-east-1', aws_access_key_id=sys.argv[2], "
                "aws_secret_access_key=sys.argv[3]).create_bucket(Bucket=sys.argv[4])")
        subprocess.run(["ip", "netns", "exec", reach_from, sys.executable, "-c", make,
                        self._endpoint(fabric), FAKE_KEY_ID, FAKE_SECRET, self.bucket],
                       check=True, capture_output=True, timeout=60)

    def _tier(self, fabric: Fabric, load_timeout_s: float) -> dict[str, Any]:
        return {"type": "s3", "bucket": self.bucket, "prefix": "fleet/",
                "endpoint_url": self._endpoint(fabric), "aws_access_key_id": FAKE_KEY_ID,
                "aws_secret_access_key": FAKE_SECRET, "connect_timeout_s": 0.5,
                "read_timeout_s": 1.0, "max_attempts": 2, "request_deadline_s": 2.0,
                "load_timeout_s": load_timeout_s}


class SharedMoto(_SharedS3):
    """moto_server (S3) on the server address."""

    name = "s3-moto"
    port = 5000

    def start(self, fabric: Fabric, workdir: Path, reach_from: str) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        log = open(workdir / "moto.log", "wb")  # noqa: SIM115 - the child holds it
        fabric.spawn(fabric.server_ns, [
            moto_server_bin(), "-H", fabric.server_address, "-p", str(self.port)],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        fabric.wait_tcp(reach_from, fabric.server_address, self.port)
        self._make_bucket(fabric, reach_from)

    def tier(self, fabric: Fabric) -> dict[str, Any]:
        # moto is one Python process: on a busy 2-core machine a GET can take a
        # second; a deadline the healthy hosts do not reach
        return self._tier(fabric, load_timeout_s=2.0)


class SharedRgw(_SharedS3):
    """A real S3 server: Ceph RGW (tests/servers.py's RgwServer: one mon, one memstore
    OSD, radosgw) with every daemon inside the server namespace, radosgw on the server
    address. About 20 s to start and 350 MB."""

    name = "s3-rgw"

    def start(self, fabric: Fabric, workdir: Path, reach_from: str) -> None:
        rgw = RgwServer(workdir, tls=False, host=fabric.server_address,
                        netns=fabric.server_ns).start()
        for proc in rgw.procs.values():
            fabric.adopt(proc)
        self.port = rgw.port
        fabric.wait_tcp(reach_from, fabric.server_address, self.port)
        self._make_bucket(fabric, reach_from)

    def tier(self, fabric: Fabric) -> dict[str, Any]:
        return self._tier(fabric, load_timeout_s=1.0)
