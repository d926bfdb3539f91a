"""The fast path's dependency on redis-py internals, checked against the pinned redis-py.

:func:`kvstore_tiers.backends.redis.fastio.raw_socket` is the only place the
backend reaches into redis-py's private state (``Connection._sock``). These
tests fail when a redis-py release changes what it relies on, and show that a
connection of another shape makes the backend fall back to plain pipelines
(with the same bytes) rather than fail.
"""

from __future__ import annotations

import inspect
import socket
from typing import Any

import numpy as np
import redis
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from vllm.v1.kv_offload.base import LookupResult

from kvstore_tiers.admin.harness import make_keys
from kvstore_tiers.backends.redis import fastio

from ...conftest import rows_like
from ...servers import RedisServer


def test_the_installed_redis_py_is_one_the_fast_path_was_written_for() -> None:
    assert Version(redis.__version__) in SpecifierSet(fastio.REDIS_PY_SUPPORTED)


def test_pyproject_bounds_redis_like_the_fast_path() -> None:
    import re
    from pathlib import Path

    pyproject = (Path(__file__).resolve().parents[3] / "pyproject.toml").read_text()
    (bound,) = re.findall(r'^redis = \["redis\[hiredis\]([^"]*)"\]', pyproject, re.M)
    assert bound == fastio.REDIS_PY_SUPPORTED


def test_a_connected_connection_exposes_its_socket(redis_server: RedisServer) -> None:
    pool = redis.BlockingConnectionPool.from_url(redis_server.url, max_connections=2)
    conn = pool.get_connection()
    try:
        conn.connect()
        sock = fastio.raw_socket(conn)
        assert isinstance(sock, socket.socket) and sock is conn._sock
        # What the fast path calls on the connection, with the keywords it passes.
        assert "check_health" in inspect.signature(conn.send_packed_command).parameters
        assert "disconnect_on_error" in inspect.signature(conn.read_response).parameters
        # A command sent through redis-py and answered off the raw socket leaves
        # redis-py's parser with nothing buffered (the next command is in sync).
        conn.send_packed_command([b"*1\r\n$4\r\nPING\r\n"], check_health=False)
        assert sock.recv(64).startswith((b"+PONG", b"$4\r\nPONG"))
        conn.send_packed_command([b"*1\r\n$4\r\nPING\r\n"], check_health=False)
        assert conn.read_response() in (b"PONG", "PONG")
    finally:
        pool.release(conn)
        pool.disconnect()


def test_fast_io_is_used_with_the_pinned_redis_py(redis_server: RedisServer,
                                                   harness_factory: Any) -> None:
    h = harness_factory([{"type": "redis", "url": redis_server.url}])
    assert h.tiers[0].backend._fast is not None


def test_a_connection_without_the_internals_falls_back_to_plain_pipelines(
        redis_server: RedisServer, harness_factory: Any, monkeypatch: Any) -> None:
    monkeypatch.setattr(fastio, "raw_socket", lambda conn: None)
    h = harness_factory([{"type": "redis", "url": redis_server.url}],
                        num_chunks=8, chunk_bytes=8192)
    assert h.tiers[0].backend._fast is None  # the guard chose plain pipelines
    keys, rows = make_keys(4, seed=5), rows_like(4, 8192, seed=5)
    h.store_all(keys, rows)
    h.forget_primary()
    ctx = h.new_request()
    results, _ = h.lookup_until_resolved(keys, ctx)
    assert results == [LookupResult.HIT] * 4
    assert np.array_equal(h.load(keys, ctx), rows)
