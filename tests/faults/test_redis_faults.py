"""Fault matrix, redis backend: real redis-server (tests/servers.py) and a RESP proxy."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvstore_tiers.harness import make_keys

from ..servers import RedisServer
from .common import HIT, MISS, Driver, rows_for, run_tamper_matrix
from .respproxy import RespProxy

BACKEND = "redis"
FAST = {"socket_timeout_s": 1.0, "connect_timeout_s": 0.5, "retries": 0,
        "failure_threshold": 1000}


@pytest.fixture
def server(redis_server_factory: Callable[..., RedisServer]) -> RedisServer:
    return redis_server_factory(["--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru"])


@pytest.fixture
def proxy(server: RedisServer) -> Iterator[RespProxy]:
    p = RespProxy(server.port)
    yield p
    p.close()


def _driver(url: str, chunk_bytes: int = 16384, **kw: Any) -> Driver:
    return Driver(BACKEND, [{"type": "redis", "url": url, **FAST, **kw}],
                  chunk_bytes=chunk_bytes)


def test_server_killed_and_restarted(server: RedisServer) -> None:
    d = _driver(server.url)
    try:
        keys = make_keys(4, seed=41)
        d.store(keys, rows_for(keys, d.row_bytes))
        d.forget_primary()
        server.kill()
        d.score.fault("server_killed")
        assert d.fetch(keys) == [MISS] * 4
        lost = make_keys(2, seed=42)
        d.store(lost, rows_for(lost, d.row_bytes), expect=False)
        assert d.tier.counters.store_failures >= 2
        server.start()  # same port, empty (no persistence)
        d.score.fault("server_restarted")
        d.forget_primary()
        assert d.fetch(keys) == [MISS] * 4  # the data is gone: misses, no errors
        d.store(keys, rows_for(keys, d.row_bytes))
        d.forget_primary()
        assert d.fetch(keys) == [HIT] * 4
    finally:
        assert d.close() == 0


def test_oom_noeviction_rejects_stores_without_partial_objects(
    redis_server_factory: Callable[..., RedisServer]
) -> None:
    srv = redis_server_factory(["--maxmemory", "3mb", "--maxmemory-policy", "noeviction"])
    d = _driver(srv.url, chunk_bytes=256 << 10, compression="none")
    try:
        keys = make_keys(16, seed=43)
        rows = rows_for(keys, d.row_bytes)
        for i in range(0, 16, 4):  # fill the server until it answers -OOM
            d.store(keys[i : i + 4], rows[i : i + 4], expect=False)
        failed = d.tier.counters.store_failures
        assert failed >= 4, "the server never answered -OOM"
        d.score.fault("oom_store_rejected", failed)
        for k, r in zip(keys, rows, strict=True):
            d.expected[k] = r.tobytes()
        d.forget_primary()
        # Whatever was accepted loads byte-exact; what was refused is a miss.
        for i in range(0, 16, 8):
            d.fetch(keys[i : i + 8])
        assert d.score.wrong_bytes == 0
    finally:
        assert d.close() == 0


@pytest.mark.parametrize("mode", ["loading", "reset"])
def test_loading_and_reset_replies(proxy: RespProxy, mode: str) -> None:
    d = _driver(proxy.url)
    try:
        keys = make_keys(4, seed=44)
        d.store(keys, rows_for(keys, d.row_bytes))
        d.forget_primary()
        proxy.set_mode(mode)
        assert d.fetch(keys) == [MISS] * 4
        more = make_keys(2, seed=45)
        d.store(more, rows_for(more, d.row_bytes), expect=False)
        if mode == "loading":
            assert proxy.replies > 0
        d.score.fault(f"{mode}_during_load_and_store", max(1, proxy.replies))
        proxy.set_mode("pass")
        d.forget_primary()
        assert d.fetch(keys) == [HIT] * 4
    finally:
        proxy.set_mode("pass")
        assert d.close() == 0


def test_tampered_and_expiring_objects(server: RedisServer) -> None:
    d = _driver(server.url)
    try:
        run_tamper_matrix(d, seed=46)
    finally:
        assert d.close() == 0
