"""Fault matrix, redis backend: a stalled server (replies held by the RESP proxy).

The proxy forwards every command to redis-server but holds its replies --
what a client sees of a hung or badly delayed server -- then lets them
through late. With ``load_timeout_s`` set, a load whose replies are held is
reported failed at its deadline (a MISS: the request recomputes), never as
wrong bytes or an exception to vLLM; the late replies that arrive after the
deadline are discarded (the rows the job owned went to other blocks); a
store whose replies are held fails after ``socket_timeout_s`` without
holding the scheduler; and once the proxy heals, the same tier serves
everything again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvstore_tiers.harness import make_keys

from ..servers import RedisServer
from .common import HIT, MISS, Driver, rows_for
from .respproxy import RespProxy

BACKEND = "redis"
CFG = {"socket_timeout_s": 1.0, "connect_timeout_s": 0.5, "retries": 0,
       "failure_threshold": 1000, "load_timeout_s": 0.3,
       "n_read_threads": 2, "n_write_threads": 1}


@pytest.fixture
def proxy(redis_server_factory: Callable[..., RedisServer]) -> Iterator[RespProxy]:
    server = redis_server_factory(["--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru"])
    p = RespProxy(server.port)
    yield p
    p.close()


def test_stalled_replies_fail_loads_at_deadline_and_stores_then_recover(
        proxy: RespProxy) -> None:
    d = Driver(BACKEND, [{"type": "redis", "url": proxy.url, **CFG}],
               num_chunks=16, chunk_bytes=65536)
    try:
        keys = make_keys(4, seed=61)
        d.store(keys, rows_for(keys, d.row_bytes))
        d.forget_primary()

        # -- loads: replies held past the deadline ---------------------------------
        proxy.stall()
        timeouts = d.tier.load_timeouts
        assert d.fetch(keys, max_wait_s=10) == [MISS] * 4
        assert d.tier.load_timeouts > timeouts, "the loads did not fail at their deadline"
        assert proxy.held > 0, "no reply was held: the loads never reached redis"
        d.score.fault("stall_during_load", proxy.held)

        # The expired job's rows are free: other blocks take them now. Then the
        # held replies arrive (late, within socket_timeout_s): the stuck load
        # threads must discard what they read, not write these rows.
        others = d.reuse_expired_rows(seed=62, release=proxy.heal)

        # -- stores: replies held past socket_timeout_s ------------------------------
        held = proxy.held
        failures = d.tier.counters.store_failures
        more = make_keys(4, seed=63)
        more_rows = rows_for(more, d.row_bytes)
        proxy.stall()
        d.store(more, more_rows)  # the SETs reach redis; their replies never come
        assert d.tier.counters.store_failures > failures, "stalled stores did not fail"
        d.score.fault("stall_during_store", proxy.held - held)

        # -- healed: the same tier serves everything again -----------------------------
        proxy.heal()
        d.forget_primary()
        d.store(more, more_rows)  # kept or rewritten: same bytes (content-addressed)
        d.forget_primary()
        for group in (keys, others, more):
            assert d.fetch(group, max_wait_s=20) == [HIT] * 4
        assert d.score.wrong_bytes == 0
        assert d.tier.counters.corrupt_objects == 0
    finally:
        proxy.heal()
        assert d.close() == 0
