"""The redis tier at network distance (a real redis-server behind the delaying proxy of
kvstore_tiers.tools.netem): a fresh engine gets a far server's pipelines whole (what a
fast link carries in a round trip is more than a pipeline: a GET held back would cost a
round trip; test_redis_window.py has the window after a load measured the path), a near
server 4 MiB of values at a time; the load threads' connections are open when start-up
returns, so a fresh engine's first load pays no connection set-up."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from vllm.v1.kv_offload.base import LookupResult

from kvstore_tiers.admin.harness import make_keys
from kvstore_tiers.backends.redis import fastio
from kvstore_tiers.tools.netem.delay import delay_proxy

from ...conftest import rows_like as random_rows
from ...servers import RedisServer
from .test_redis_get_depth import _spy_on_outstanding_gets

HIT = LookupResult.HIT
ROW = 64 << 10
#: Rows of the depth test: big enough that a near server's window (4 MiB) holds 3.
BIG = 1 << 20
RTT_MS = 40


def _load_all(h: Any, keys: list[bytes], rows: np.ndarray) -> None:
    h.forget_primary()
    ctx = h.new_request()
    results, _ = h.lookup_until_resolved(keys, ctx)
    assert results == [HIT] * len(keys)
    assert np.array_equal(h.load(keys, ctx), rows)
    h.finish_request(ctx)


@pytest.mark.parametrize("far", [False, True], ids=["loopback", f"rtt{RTT_MS}ms"])
def test_a_far_server_gets_a_pipelines_gets_at_once(
        redis_server: RedisServer, harness_factory: Any, far: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    if not far:  # loopback on a busy machine can answer late: "near" is under 0.5 s here
        monkeypatch.setattr(fastio, "FAR_S", 0.5)
    cfg = {"type": "redis", "url": redis_server.url, "compression": "none",
           "pipeline_batch": 8, "n_read_threads": 1, "n_write_threads": 1,
           "eviction_events": "off"}
    keys, rows = make_keys(16, seed=5), random_rows(16, BIG, seed=5)
    harness_factory([cfg], num_chunks=16, chunk_bytes=BIG).store_all(keys, rows)
    with delay_proxy(("127.0.0.1", redis_server.port), RTT_MS) as (host, port):
        url = f"redis://{host}:{port}/0" if far else redis_server.url
        h = harness_factory([{**cfg, "url": url, "socket_timeout_s": 10.0}],
                            num_chunks=16, chunk_bytes=BIG)
        fast = h.tiers[0].backend._fast
        assert fast.get_depth is None and fast.far is far  # measured at start-up
        worst = _spy_on_outstanding_gets(fast)
        _load_all(h, keys, rows)
    assert fast.far is far
    # near: 4 MiB of values in flight (3 frames of a little over 1 MiB); far: all 8
    assert max(worst.values()) == (8 if far else 3)


def test_a_fixed_get_depth_holds_at_distance(redis_server: RedisServer,
                                             harness_factory: Any) -> None:
    cfg = {"type": "redis", "url": redis_server.url, "compression": "none",
           "pipeline_batch": 8, "n_read_threads": 1, "n_write_threads": 1,
           "eviction_events": "off", "get_depth": 3}
    keys, rows = make_keys(8, seed=6), random_rows(8, ROW, seed=6)
    harness_factory([cfg], num_chunks=8, chunk_bytes=ROW).store_all(keys, rows)
    with delay_proxy(("127.0.0.1", redis_server.port), RTT_MS) as (host, port):
        h = harness_factory([{**cfg, "url": f"redis://{host}:{port}/0"}], num_chunks=8,
                            chunk_bytes=ROW)
        worst = _spy_on_outstanding_gets(h.tiers[0].backend._fast)
        _load_all(h, keys, rows)
    assert max(worst.values()) == 3


def test_the_load_threads_connections_are_open_after_start(redis_server: RedisServer,
                                                            harness_factory: Any) -> None:
    with redis_server.client() as c:
        before = int(c.info("clients")["connected_clients"])
        harness_factory([{"type": "redis", "url": redis_server.url, "n_read_threads": 6,
                          "eviction_events": "off"}], chunk_bytes=ROW)
        after = int(c.info("clients")["connected_clients"])
    assert after - before >= 6


def test_warming_works_with_redis_py_5s_pool_signature() -> None:
    """redis-py 5's ConnectionPool.get_connection requires a command name (6 and later
    take none); the pyproject allows 5, so warming must open connections there too."""
    from kvstore_tiers.backends.redis.client import warm_pool

    class Pool5:
        def __init__(self) -> None:
            self.out: list[object] = []
            self.back: list[object] = []

        def get_connection(self, command_name: str, *keys: object, **options: object) -> object:
            conn = object()
            self.out.append(conn)
            return conn

        def release(self, conn: object) -> None:
            self.back.append(conn)

    pool = Pool5()
    assert warm_pool(pool, 3) == 3
    assert len(pool.out) == 3 and sorted(map(id, pool.back)) == sorted(map(id, pool.out))
