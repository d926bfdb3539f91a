"""Fault matrix, s3 backend: moto and Ceph RGW behind the loopback fault proxy
(tests/faults/faultproxy.py).

What a user cares about: transient errors are retried and invisible; a broken
endpoint costs recomputation only (failed jobs, then the circuit opens and
lookups miss at once), never wrong bytes and never an exception into vLLM;
the tier recovers by itself when the endpoint heals. The tests after
``fast_fail`` drive vLLM's manager through tests/backends/s3/s3_helpers.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import pytest

from kvstore_tiers.admin.harness import build_harness, make_keys
from kvstore_tiers.backends.s3 import S3Backend
from kvstore_tiers.backends.s3.client import EventLoop
from kvstore_tiers.backends.s3.config import as_config
from kvstore_tiers.errors import ConfigError
from kvstore_tiers.health import BreakerState

from ..backends.s3.s3_helpers import fetch, harness, random_rows
from ..servers import run_moto, s3_client, s3_server_fixture, tier_config_factory
from .common import HIT, MISS, Driver, rows_for, run_tamper_matrix, score
from .faultproxy import FaultProxy

BACKEND = "s3"
s3_endpoint = s3_server_fixture()


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
        assert tier.gauges()["circuit_state"] == float(BreakerState.OPEN)
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
        assert tier.gauges()["circuit_state"] == float(BreakerState.CLOSED)
    finally:
        proxy.heal()
        assert d.close() == 0


def fast_fail(tier_config: Any, proxy: FaultProxy, **kw: Any) -> dict[str, Any]:
    """Tier config through the proxy, with short timeouts and a quick breaker."""
    base = dict(endpoint_url=proxy.url, max_attempts=1, connect_timeout_s=0.5,
                read_timeout_s=1.0, failure_threshold=2, breaker_cooldown_s=0.3)
    return tier_config(**{**base, **kw})


def test_transient_errors_are_retried(tier_config: Any, proxy: FaultProxy) -> None:
    h = harness(tier_config(endpoint_url=proxy.url, max_attempts=3))
    try:
        keys, rows = make_keys(6, seed=10), random_rows(6, 16384, seed=10)
        proxy.error(503, "SlowDown", count=2, methods={"PUT"})
        h.store_all(keys, rows)
        tier = h.tiers[0]
        assert proxy.faults_served == 2
        assert (tier.counters.objects_stored, tier.counters.store_failures) == (6, 0)
        h.forget_primary()
        proxy.error(500, "InternalError", count=1, methods={"GET"})
        results, got, _ = fetch(h, keys)
        assert proxy.faults_served == 3
        assert results == [HIT] * 6 and np.array_equal(got, rows)
        assert tier.counters.load_failures == 0
    finally:
        h.shutdown()


def wait_for_hits(h: Any, keys: list[bytes], timeout_s: float = 20.0) -> np.ndarray:
    """New requests until the tier answers HIT again (breaker cooldown, half-open probe)."""
    deadline = time.monotonic() + timeout_s
    while True:
        results, got, ctx = fetch(h, keys)
        h.finish_request(ctx)
        if results == [HIT] * len(keys):
            return got
        assert time.monotonic() < deadline, f"tier did not recover: {results}"


def test_persistent_failure_opens_circuit_then_recovers(
    tier_config: Any, proxy: FaultProxy
) -> None:
    h = harness(fast_fail(tier_config, proxy))
    try:
        tier = h.tiers[0]
        keys, rows = make_keys(4, seed=11), random_rows(4, 16384, seed=11)
        h.store_all(keys, rows)
        h.forget_primary()

        proxy.error(503, "ServiceUnavailable")  # every request, until healed
        # Loads of blocks the tier knows it holds fail: MISS, nothing loaded.
        for _ in range(2):
            results, got, ctx = fetch(h, keys)
            h.finish_request(ctx)
            assert results == [MISS] * 4 and got is None
        # Stores fail too (or are dropped once the circuit is open).
        more, more_rows = make_keys(4, seed=12), random_rows(4, 16384, seed=12)
        h.store_all(more, more_rows)
        c = tier.counters
        assert c.load_failures >= 2
        assert c.objects_stored == 4 and c.store_failures + c.stores_dropped >= 1
        assert tier.breaker.state is BreakerState.OPEN

        # Circuit open: lookups miss at once, without a request to the server.
        sent = sum(proxy.requests.values())
        ctx = h.new_request()
        results, steps = h.lookup_until_resolved(make_keys(5, seed=13), ctx)
        assert results == [MISS] * 5 and steps == 1
        assert sum(proxy.requests.values()) == sent
        h.finish_request(ctx)

        proxy.heal()
        got = wait_for_hits(h, keys)
        assert np.array_equal(got, rows)
        assert tier.breaker.state is BreakerState.CLOSED
    finally:
        h.shutdown()


@pytest.mark.parametrize("fault", ["reset", "truncate", "stall"])
def test_broken_transfers_deliver_no_wrong_bytes(
    tier_config: Any, proxy: FaultProxy, s3: Any, bucket: str, fault: str
) -> None:
    h = harness(fast_fail(tier_config, proxy, failure_threshold=50, read_timeout_s=0.5))
    try:
        tier = h.tiers[0]
        keys, rows = make_keys(5, seed=14), random_rows(5, 16384, seed=14)
        h.store_all(keys, rows)
        h.forget_primary()
        getattr(proxy, fault)(methods={"GET"})
        results, got, ctx = fetch(h, keys)
        # Every load failed: MISS for this request, nothing handed to vLLM.
        assert results == [MISS] * 5 and got is None
        assert tier.counters.load_failures == 5
        assert tier.counters.corrupt_objects == 0
        # A broken transfer is not a broken object: it stays in the bucket.
        for k in keys:
            s3.head_object(Bucket=bucket, Key="test/" + tier.namespace.object_name(k))
        h.finish_request(ctx)
        proxy.heal()
        results, got, _ = fetch(h, keys)
        assert results == [HIT] * 5 and np.array_equal(got, rows)
    finally:
        h.shutdown()


def test_endpoint_gone_at_runtime_fails_fast_and_recovers(
    tier_config: Any, proxy: FaultProxy
) -> None:
    h = harness(fast_fail(tier_config, proxy, failure_threshold=1))
    other = None
    try:
        tier = h.tiers[0]
        keys, rows = make_keys(4, seed=15), random_rows(4, 16384, seed=15)
        h.store_all(keys, rows)
        proxy.reset()  # every connection is reset: the server is gone
        new, new_rows = make_keys(4, seed=16), random_rows(4, 16384, seed=16)
        h.store_all(new, new_rows)
        assert tier.counters.store_failures == 4
        assert tier.breaker.state is BreakerState.OPEN
        # Another engine sees nothing of the lost stores once S3 is back.
        proxy.heal()
        # No negative cache for the observer: it must see h's later stores at
        # once (with the default 2 s it may keep answering "absent" briefly).
        other = harness(tier_config(negative_cache_s=0))
        results, _, ctx = fetch(other, new)
        assert results == [MISS] * 4
        other.finish_request(ctx)
        # And this tier stores again by itself after the cooldown.
        h.forget_primary()
        got = wait_for_hits(h, keys)
        assert np.array_equal(got, rows)
        h.store_all(new, new_rows)
        results, got, _ = fetch(other, new)
        assert results == [HIT] * 4 and np.array_equal(got, new_rows)
    finally:
        h.shutdown()
        if other is not None:
            other.shutdown()


# -- endpoints that are not (or no longer) S3 ----------------------------------------------
class _NotS3(BaseHTTPRequestHandler):
    """A plain web server: 200 and an empty body for every request, whatever it is."""

    def _ok(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _ok

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass


@contextlib.contextmanager
def _not_s3_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NotS3)
    thread = threading.Thread(target=server.serve_forever, name="faultproxy-not-s3",
                              daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def _black_hole() -> Iterator[str]:
    """An endpoint that accepts connections (the kernel's backlog) and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def _startup_error(url: str) -> tuple[str, float]:
    """Start a tier on ``url`` with the default timeouts; (its start-up error, seconds)."""
    cfg = tier_config_factory("kvf-startup", url, "f/", connect_timeout_s=2.0)()
    del cfg["read_timeout_s"]  # the defaults are what is tested
    start = time.monotonic()
    with pytest.raises(ConfigError) as err:
        build_harness([cfg], num_chunks=4, chunk_bytes=4096).shutdown()
    return str(err.value), time.monotonic() - start


def test_an_endpoint_that_is_not_s3_fails_startup_naming_it() -> None:
    """A web server answering 200 to everything must not pass for S3 (stores into nothing)."""
    with _not_s3_server() as url:
        message, _took = _startup_error(url)
    score(BACKEND).fault("startup_not_s3")
    assert url in message and "does not behave like S3" in message


def test_a_black_hole_endpoint_fails_startup_within_seconds() -> None:
    with _black_hole() as url:
        message, _took = _startup_error(url)
        cfg = tier_config_factory("kvf-startup", url, "f/", connect_timeout_s=2.0)()
        del cfg["read_timeout_s"]
        backend = S3Backend(as_config(cfg), None)
        start = time.monotonic()
        with pytest.raises(ConfigError):
            backend.open()  # the start-up probe alone, without the engine around it
        took = time.monotonic() - start
    score(BACKEND).fault("startup_black_hole")
    print(f"s3 black-hole endpoint: start-up probe failed after {took:.1f}s: {message}")
    assert url in message and "did not answer" in message
    assert took < 15.0  # about 7 s on a quiet machine (46 s with the old defaults)


def test_a_black_hole_at_run_time_is_a_miss_within_the_default_deadline(
        proxy: FaultProxy) -> None:
    """Every request stalls (the endpoint stops answering): with the default timeouts a
    load is a MISS well before a minute, and the failure counts for the breaker."""
    cfg = _cfg(proxy, f"kvf-{uuid.uuid4().hex[:12]}")
    for key in ("read_timeout_s", "max_attempts"):
        del cfg[key]  # the defaults are what is tested
    d = Driver(BACKEND, [cfg])
    try:
        keys = make_keys(4, seed=41)
        d.store(keys, rows_for(keys, d.row_bytes))
        d.forget_primary()
        proxy.stall()
        start = time.monotonic()
        assert d.fetch(keys, max_wait_s=30.0) == [MISS] * 4
        took = time.monotonic() - start
        d.score.fault("black_hole_load", proxy.faults_served)
        print(f"s3 black-hole endpoint: time to a miss {took:.1f}s")
        assert took < 15.0
        assert d.tier.counters.load_failures >= 1
        proxy.heal()
        assert d.fetch(keys) == [HIT] * 4
    finally:
        proxy.heal()
        assert d.close() == 0


def test_dropped_connections_log_one_line_not_a_traceback_each(
        caplog: pytest.LogCaptureFixture) -> None:
    """Tasks whose exception nobody retrieves (aiohttp's, on dropped connections) are
    logged by the data path's loop once per interval, without a traceback."""
    loop = EventLoop("kvstore_s3_loop_test")
    loop.start()

    async def drop_connections(n: int) -> None:
        async def dropped() -> None:
            raise ConnectionResetError("connection reset by peer")

        tasks = [asyncio.ensure_future(dropped()) for _ in range(n)]
        await asyncio.sleep(0.05)
        del tasks  # never retrieved: asyncio reports each when the task is freed
        gc.collect()

    try:
        with caplog.at_level(logging.DEBUG, logger="kvstore_tiers"):
            caplog.clear()
            loop.run(drop_connections(50), timeout=10.0)
    finally:
        loop.stop()
    score(BACKEND).fault("loop_task_exceptions", 50)
    lines = [r for r in caplog.records if "Task exception was never retrieved" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert lines[0].exc_info is None and "ConnectionResetError" in lines[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
