"""Fixtures of the s3 tests: a moto S3 server subprocess, buckets, tier configs.

``moto_endpoint`` starts ``moto_server`` from the venv's bin directory on a
free 127.0.0.1 port once per session and stops it by PID. Every test gets
its own bucket (``bucket`` fixture), so tests never see each other's objects.
Fake credentials are given through the tier config (and the environment,
for boto3 clients the tests build themselves).
"""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aiobotocore")
pytest.importorskip("moto")

FAKE_KEY_ID = "AKIATESTFAKEKEYID001"
FAKE_SECRET = "fakeSecretAccessKey/DoNotLog+42"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def moto_server_bin() -> str:
    path = Path(sys.executable).parent / "moto_server"
    if not path.exists():
        pytest.skip("moto_server is not installed in this environment")
    return str(path)


@contextlib.contextmanager
def run_moto(env: dict[str, str] | None = None, *,
             tls: tuple[str, str, str] | None = None) -> Iterator[str]:
    """Start moto_server on a free port; yield its URL; stop it by PID.

    ``tls=(cert, key, ca)``: serve https with that certificate (the start-up
    probe trusts ``ca``).
    """
    port = free_port()
    args = [moto_server_bin(), "-H", "127.0.0.1", "-p", str(port)]
    ctx = None
    if tls is not None:
        cert, key, ca = tls
        args += ["-c", cert, "-k", key]
        ctx = ssl.create_default_context(cafile=ca)
    proc = subprocess.Popen(
        args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )
    url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {proc.returncode}")
            try:
                urllib.request.urlopen(f"{url}/moto-api/data.json", timeout=1,
                                       context=ctx).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("moto_server did not answer within 30s") from None
                time.sleep(0.1)  # polling for server start-up, not a test condition
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
    with run_moto() as url:
        yield url


@pytest.fixture(autouse=True)
def _fake_aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # Never pick up a developer's real AWS profile or keys.
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
    """A loopback fault proxy in front of the moto server (tests/s3/faultproxy.py)."""
    from .faultproxy import FaultProxy

    p = FaultProxy(moto_endpoint)
    yield p
    p.close()
