"""Fault matrix, s3 backend: moto behind the loopback fault proxy (tests/faults/faultproxy.py)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from kvstore_tiers.harness import make_keys
from kvstore_tiers.health import BreakerState

from ..servers import run_moto, s3_client, tier_config_factory
from .common import HIT, MISS, Driver, rows_for, run_tamper_matrix
from .faultproxy import FaultProxy

BACKEND = "s3"


def _cfg(proxy: FaultProxy, bucket: str, **kw: Any) -> dict[str, Any]:
    make = tier_config_factory(bucket, proxy.url, "f/", connect_timeout_s=0.5)
    return make(**{"create_bucket": True, "max_attempts": 1, "read_timeout_s": 1.0,
                   "failure_threshold": 1000, **kw})


@pytest.fixture
def driver(proxy: FaultProxy) -> Iterator[Driver]:
    d = Driver(BACKEND, [_cfg(proxy, f"kvf-{uuid.uuid4().hex[:12]}")])
    yield d
    proxy.heal()
    assert d.close() == 0


FAULTS = [pytest.param("error", (500, "InternalError"), id="500"),
          pytest.param("error", (503, "ServiceUnavailable"), id="503"),
          pytest.param("error", (503, "SlowDown"), id="throttle"),
          pytest.param("reset", (), id="reset"), pytest.param("stall", (), id="stall")]


@pytest.mark.parametrize("kind,args", FAULTS)
def test_store_faults_leave_no_partial_object(driver: Driver, proxy: FaultProxy, kind: str,
                                              args: tuple[Any, ...]) -> None:
    keys = make_keys(4, seed=31)
    rows = rows_for(keys, driver.row_bytes)
    getattr(proxy, kind)(*args, methods={"PUT"})
    driver.store(keys, rows, expect=False)
    driver.score.fault(f"store_{kind}{args[1:2]}", proxy.faults_served)
    proxy.heal()
    assert driver.tier.counters.store_failures == 4
    driver.forget_primary()
    assert driver.fetch(keys) == [MISS] * 4  # no partial object became visible
    driver.store(keys, rows)
    driver.forget_primary()
    assert driver.fetch(keys) == [HIT] * 4


@pytest.mark.parametrize("kind,args", [*FAULTS, pytest.param("truncate", (), id="truncate")])
def test_load_faults_are_misses(driver: Driver, proxy: FaultProxy, kind: str,
                                args: tuple[Any, ...]) -> None:
    keys = make_keys(4, seed=32)
    driver.store(keys, rows_for(keys, driver.row_bytes))
    driver.forget_primary()
    getattr(proxy, kind)(*args, methods={"GET"})
    assert driver.fetch(keys) == [MISS] * 4
    driver.score.fault(f"load_{kind}{args[1:2]}", proxy.faults_served)
    proxy.heal()
    assert driver.fetch(keys) == [HIT] * 4


def test_server_killed_and_restarted() -> None:
    """moto dies mid-run (killed: its in-memory objects are gone), then a new one starts."""
    first = run_moto()
    url = first.__enter__()
    proxy = FaultProxy(url)
    bucket = f"kvf-{uuid.uuid4().hex[:12]}"
    d = Driver(BACKEND, [_cfg(proxy, bucket)])
    try:
        keys = make_keys(4, seed=33)
        d.store(keys, rows_for(keys, d.row_bytes))
        d.forget_primary()
        first.__exit__(None, None, None)  # the server is gone
        d.score.fault("server_killed")
        assert d.fetch(keys) == [MISS] * 4
        d.store(make_keys(2, seed=37), rows_for(make_keys(2, seed=37), d.row_bytes),
                expect=False)
        with run_moto() as url2:
            host, port = url2.removeprefix("http://").split(":")
            proxy.upstream = (host, int(port))  # restarted (empty) behind the same endpoint
            d.score.fault("server_restarted")
            d.forget_primary()
            assert d.fetch(keys) == [MISS] * 4  # lost objects are misses, not errors
            s3_client(url2).create_bucket(Bucket=bucket)
            d.store(keys, rows_for(keys, d.row_bytes))
            d.forget_primary()
            assert d.fetch(keys) == [HIT] * 4
            assert d.close() == 0
    finally:
        d.close()
        proxy.close()


def test_tampered_and_expiring_objects(driver: Driver) -> None:
    run_tamper_matrix(driver, seed=34)


def test_breaker_opens_probes_and_closes(proxy: FaultProxy) -> None:
    d = Driver(BACKEND, [_cfg(proxy, f"kvf-{uuid.uuid4().hex[:12]}", failure_threshold=2,
                              breaker_cooldown_s=0.3)])
    try:
        tier = d.tier
        keys = make_keys(4, seed=35)
        d.store(keys, rows_for(keys, d.row_bytes))
        d.forget_primary()
        proxy.error(503, "ServiceUnavailable")
        # Two failed jobs in a row: a load, then a store.
        assert d.fetch(keys) == [MISS] * 4
        failing = make_keys(2, seed=38)
        d.store(failing, rows_for(failing, d.row_bytes), expect=False)
        d.score.fault("breaker_503_storm", proxy.faults_served)
        assert tier.breaker.state is BreakerState.OPEN
        assert tier._gauges()["circuit_state"] == float(BreakerState.OPEN)
        sent = sum(proxy.requests.values())
        more = make_keys(3, seed=36)
        assert d.fetch(more) == [MISS] * 3  # open: answered at once, nothing sent
        d.store(more, rows_for(more, d.row_bytes), expect=False)  # dropped, counted
        assert sum(proxy.requests.values()) == sent
        assert tier.counters.stores_dropped >= 3
        proxy.heal()
        time.sleep(0.35)  # cooldown; the next job is the half-open probe
        deadline = time.monotonic() + 10
        while d.fetch(keys) != [HIT] * 4:
            assert time.monotonic() < deadline
        assert tier.breaker.state is BreakerState.CLOSED
        assert tier._gauges()["circuit_state"] == float(BreakerState.CLOSED)
    finally:
        proxy.heal()
        assert d.close() == 0
