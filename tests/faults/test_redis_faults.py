"""Fault matrix, redis backend: real redis-server (tests/servers.py) and a RESP proxy.

A stalled server (replies held by the RESP proxy): the proxy forwards every
command to redis-server but holds its replies -- what a client sees of a hung
or badly delayed server -- then lets them through late. With
``load_timeout_s`` set, a load whose replies are held is reported failed at
its deadline (a MISS: the request recomputes), never as wrong bytes or an
exception to vLLM; the late replies that arrive after the deadline are
discarded (the rows the job owned went to other blocks); a store whose
replies are held fails after ``socket_timeout_s`` without holding the
scheduler; and once the proxy heals, the same tier serves everything again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from redis.crc import key_slot

from kvstore_tiers.admin.harness import make_keys
from kvstore_tiers.health import CircuitBreaker

from ..servers import RedisCluster, RedisServer
from .common import HIT, MISS, Driver, rows_for, run_tamper_matrix
from .respproxy import RespProxy

BACKEND = "redis"
FAST = {"socket_timeout_s": 1.0, "connect_timeout_s": 0.5, "retries": 0,
        "failure_threshold": 1000}
#: A stalled server: loads fail at ``load_timeout_s``.
STALL = {**FAST, "load_timeout_s": 0.3, "n_read_threads": 2, "n_write_threads": 1}


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


def test_stalled_replies_fail_loads_at_deadline_and_stores_then_recover(
        proxy: RespProxy) -> None:
    d = Driver(BACKEND, [{"type": "redis", "url": proxy.url, **STALL}],
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


# -- Redis Cluster: one master killed ----------------------------------------------------------
class _SlotOwners:
    """Which master holds each block's slot, from ``CLUSTER SLOTS`` read once, before any
    kill: a client opened after a master died could itself fail on the dead node."""

    def __init__(self, cluster: RedisCluster, tier: Any) -> None:
        self._tier = tier
        self._port = [0] * 16384
        with cluster.nodes[1].client() as c:
            for start, end, master, *_ in c.execute_command("CLUSTER", "SLOTS"):
                self._port[int(start):int(end) + 1] = [int(master[1])] * (end - start + 1)

    def __call__(self, keys: list[bytes]) -> list[int]:
        return [self._port[key_slot(f"kvstore:{self._tier.namespace.object_name(k)}"
                                    .encode())] for k in keys]


def _cluster_cfg(cluster: RedisCluster, **kw: Any) -> dict[str, Any]:
    return {"type": "redis", "nodes": cluster.addresses, "pipeline_batch": 16,
            "socket_timeout_s": 1.0, "connect_timeout_s": 0.5, "retries": 0, **kw}


def test_shutdown_after_a_cluster_node_failure_unmaps_the_primary(
        redis_cluster: RedisCluster) -> None:
    """Errors of the dead node's keys must not keep views of vLLM's primary alive
    (neither through a kept traceback nor through frames redis-py's cluster client
    leaves in reference cycles, whose ``f_back`` would reach the load path)."""
    d = Driver(BACKEND, [_cluster_cfg(redis_cluster, failure_threshold=1000)],
               num_chunks=48, chunk_bytes=8192)
    closed = False
    try:
        keys = make_keys(32, seed=51)
        d.store(keys, rows_for(keys, d.row_bytes))
        down = redis_cluster.nodes[0]
        owners = _SlotOwners(redis_cluster, d.tier)(keys)
        assert 0 < owners.count(down.port) < len(keys)
        d.forget_primary()
        down.kill()
        d.score.fault("cluster_master_killed_then_shutdown")
        res = d.fetch(keys)
        assert [r == HIT for r in res] == [p != down.port for p in owners]
        mm = d.h.spec._scheduler_mmap.mmap_obj
        assert d.close() == 0
        closed = True
        with pytest.raises(ValueError):  # closed: no kept error held a view of it
            len(mm)
    finally:
        if not closed:
            d.close()


@pytest.mark.parametrize("breaker", [
    pytest.param({"failure_threshold": 1000}, id="backend"),
    pytest.param({}, id="default-breaker", marks=pytest.mark.skipif(
        not hasattr(CircuitBreaker, "record_keys"),
        reason="needs the circuit breaker that counts a job by its keys")),
])
def test_a_dead_cluster_master_costs_only_its_own_keys(redis_cluster: RedisCluster,
                                                       breaker: dict[str, Any]) -> None:
    """Three masters, ``cluster-require-full-coverage no``, one killed: lookups, loads and
    stores of keys on the live masters keep working, per node, not per batch -- with the
    breaker out of the way (what the backend does) and at its defaults (the whole tier)."""
    d = Driver(BACKEND, [_cluster_cfg(redis_cluster, **breaker)], num_chunks=96,
               chunk_bytes=8192)
    try:
        keys = make_keys(32, seed=52)
        d.store(keys, rows_for(keys, d.row_bytes))
        down = redis_cluster.nodes[0]
        owners_of = _SlotOwners(redis_cluster, d.tier)
        owners = owners_of(keys)
        live = [p != down.port for p in owners]
        down.kill()
        d.score.fault(f"cluster_master_killed_{'breaker_off' if breaker else 'defaults'}")
        # Each round six requests store new blocks (spread over every master, so nearly
        # every store job has keys on the dead one), then a request reads the old ones.
        rounds, live_hits, dead_hits, stored, stored_live = 6, 0, 0, 0, 0
        for r in range(rounds):
            for j in range(6):
                more = make_keys(8, seed=1000 + 10 * r + j)
                more_owners = owners_of(more)
                before = d.tier.counters.objects_stored
                d.store(more, rows_for(more, d.row_bytes), expect=False)
                stored += d.tier.counters.objects_stored - before
                stored_live += sum(p != down.port for p in more_owners)
            d.forget_primary()
            res = d.fetch(keys)
            live_hits += sum(h == HIT for h, ok in zip(res, live, strict=True) if ok)
            dead_hits += sum(h == HIT for h, ok in zip(res, live, strict=True) if not ok)
        rate = live_hits / (rounds * sum(live))
        print(f"redis cluster, one master of three killed ({breaker or 'default breaker'}): "
              f"hit rate of keys on the live masters {rate:.1%} over {rounds} rounds of "
              f"{len(keys)} keys; {stored} of {stored_live} new blocks for live masters stored")
        assert dead_hits == 0 and rate >= 0.99
        # Every store of a live master's key lands, at the defaults too: vLLM 0.33's
        # backpressure detector hears only the failures the breaker counts, not the
        # jobs that failed in part (kvstore_tiers/backpressure.py).
        assert stored == stored_live
    finally:
        assert d.close() == 0
