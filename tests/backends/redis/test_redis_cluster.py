"""The redis tier on a real three-master Redis Cluster (loopback ports).

Blocks must spread over the masters (no hash tag), a batch spanning nodes
must round-trip, and with one master stopped the keys it held fail as misses
while the other masters' keys still load -- no exception into vLLM.
"""

from __future__ import annotations

import contextlib
import socket
from typing import Any

import numpy as np
import pytest
from vllm.v1.kv_offload.base import LookupResult

from kvstore_tiers.admin.harness import make_keys

from ...conftest import rows_like as random_rows

HIT, MISS = LookupResult.HIT, LookupResult.MISS


def cluster_cfg(cluster: Any, **kw: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"type": "redis", "cluster": True, "nodes": cluster.addresses,
                           "n_read_threads": 2, "n_write_threads": 2, "retries": 1,
                           "failure_threshold": 1000, "pipeline_batch": 16}
    cfg.update(kw)
    return cfg




def fetch(h: Any, keys: list[bytes]) -> tuple[list[Any], np.ndarray]:
    h.forget_primary()
    ctx = h.new_request()
    results, _ = h.lookup_until_resolved(keys, ctx)
    hits = [k for k, r in zip(keys, results, strict=True) if r == HIT]
    got = h.load(hits, ctx) if hits else np.empty((0, 0), np.uint8)
    h.finish_request(ctx)
    return results, got


def test_cluster_round_trip_spreads_keys(redis_cluster, harness_factory):
    h = harness_factory([cluster_cfg(redis_cluster)], num_chunks=48, chunk_bytes=8192)
    keys, rows = make_keys(32, seed=1), random_rows(32, 8192, seed=1)
    h.store_all(keys, rows)
    assert h.tiers[0].counters.objects_stored == 32
    per_node = []
    for node in redis_cluster.nodes:
        with node.client() as c:
            per_node.append(c.dbsize())
    assert sum(per_node) == 32 and all(n > 0 for n in per_node)  # every master holds some

    # A second engine finds them through the cluster (EXISTS per key).
    other = harness_factory([cluster_cfg(redis_cluster)], num_chunks=48, chunk_bytes=8192)
    results, got = fetch(other, keys)
    assert results == [HIT] * 32 and np.array_equal(got, rows)


def test_cluster_node_down_fails_its_keys_only(redis_cluster, harness_factory):
    h = harness_factory([cluster_cfg(redis_cluster)], num_chunks=48, chunk_bytes=8192)
    keys, rows = make_keys(32, seed=2), random_rows(32, 8192, seed=2)
    h.store_all(keys, rows)
    tier = h.tiers[0]
    ns = tier.namespace
    down = redis_cluster.nodes[0]
    with down.client() as c:  # a plain client: SCAN lists this node's keys only
        held = set(c.scan_iter(match="kvstore:*"))
    on_down = {k for k in keys if f"kvstore:{ns.object_name(k)}".encode() in held}
    assert 0 < len(on_down) < 32
    down.kill()

    results, got = fetch(h, keys)  # presence says HIT for all; loads decide
    hit_idx = [i for i, r in enumerate(results) if r == HIT]
    assert {keys[i] for i in hit_idx} == set(keys) - on_down
    assert np.array_equal(got, rows[hit_idx])
    assert tier.counters.load_failures == len(on_down)

    # A new engine: lookups for the dead node's keys answer MISS, the rest HIT.
    other = harness_factory([cluster_cfg(redis_cluster)], num_chunks=48, chunk_bytes=8192)
    results, got = fetch(other, keys)
    assert [r == HIT for r in results] == [k not in on_down for k in keys]
    hit_idx = [i for i, r in enumerate(results) if r == HIT]
    assert np.array_equal(got, rows[hit_idx])

    # Stores keep working for the live masters.
    more, more_rows = make_keys(16, seed=3), random_rows(16, 8192, seed=3)
    h.store_all(more, more_rows)
    c = tier.counters
    assert c.objects_stored > 32 and c.objects_stored + c.store_failures == 48


@pytest.mark.parametrize("holder", ["socket", "redis"])
def test_a_server_whose_port_was_taken_after_the_pick_starts_on_another(tmp_path, holder) -> None:
    """The harness itself: a port taken between the pick and redis-server's
    bind (by any process on the machine) costs a retry, not the test run; a
    Redis already there is not mistaken for the one started."""
    from ...servers import RedisServer, free_low_port, need_redis_server

    need_redis_server()
    with contextlib.ExitStack() as stack:
        if holder == "socket":
            taken = stack.enter_context(socket.socket())
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            busy = taken.getsockname()[1]
        else:
            other = RedisServer(tmp_path / "other").start()
            stack.callback(other.stop)
            busy = other.port
        picks = iter([busy])
        srv = RedisServer(tmp_path / "node", pick_port=lambda: next(picks, free_low_port()))
        assert srv.port == busy
        stack.callback(srv.stop)
        srv.start()
        assert srv.port != busy and srv.proc is not None
        with srv.client() as c:
            assert c.info("server")["process_id"] == srv.proc.pid
        found = srv.port
        srv.restart()  # a restart keeps the port it found
        assert srv.port == found
        with srv.client() as c:
            assert c.info("server")["process_id"] == srv.proc.pid
