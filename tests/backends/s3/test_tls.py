"""S3 over TLS with a custom CA (issue #7): an https moto_server with a test CA."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ...pki import make_pki
from ...servers import run_moto, s3_client, tier_config_factory
from .s3_helpers import HIT, fetch, harness, make_keys, random_rows
from .test_startup import build_error

pytest.importorskip("cryptography")


@pytest.fixture(scope="module")
def https_moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(https endpoint, CA bundle path) of a moto_server with a certificate of our CA."""
    pki = make_pki(Path(tmp_path_factory.mktemp("s3-pki")))
    with run_moto(tls=(pki["server_cert"], pki["server_key"], pki["ca"])) as url:
        yield url, pki["ca"]


@pytest.fixture
def tls_config(https_moto: tuple[str, str]) -> Any:
    url, ca = https_moto
    bucket = f"kvt-tls-{uuid.uuid4().hex[:12]}"
    s3_client(url, verify=ca).create_bucket(Bucket=bucket)
    return tier_config_factory(bucket, url, "tls/", connect_timeout_s=2.0)


def round_trip(cfg: dict[str, Any], n: int = 12, seed: int = 3) -> None:
    """Store ``n`` rows with one engine, read them back byte-exact with another."""
    keys, rows = make_keys(n, seed=seed), random_rows(n, 16384, seed=seed)
    writer = harness(cfg)
    try:
        writer.store_all(keys, rows)
        assert writer.tiers[0].counters.objects_stored == n
    finally:
        writer.shutdown()
    reader = harness(cfg)  # a fresh engine: HEADs and GETs over TLS
    try:
        results, got, _ = fetch(reader, keys)
        assert results == [HIT] * n
        assert got is not None and np.array_equal(got, rows)
    finally:
        reader.shutdown()


def test_custom_ca_bundle_round_trips(tls_config: Any, https_moto: tuple[str, str]) -> None:
    _, ca = https_moto
    round_trip(tls_config(ca_bundle=ca))


def test_without_the_ca_startup_fails_naming_tls(tls_config: Any) -> None:
    msg = build_error(tls_config())  # verify on, system CAs only
    assert "TLS" in msg and "certificate" in msg.lower(), msg
    assert "ca_bundle" in msg  # says how to fix it


def test_wrong_ca_bundle_fails_startup(tls_config: Any, tmp_path: Path) -> None:

    other = make_pki(tmp_path)  # a different CA, same names
    msg = build_error(tls_config(ca_bundle=other["ca"]))
    assert "TLS" in msg and "certificate" in msg.lower(), msg


def test_verify_tls_false_works_and_warns(tls_config: Any,
                                          caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvstore_tiers"):
        round_trip(tls_config(verify_tls=False), seed=4)
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno >= logging.WARNING and "verify_tls" in r.getMessage()]
    assert warnings and "not verified" in warnings[0], warnings
