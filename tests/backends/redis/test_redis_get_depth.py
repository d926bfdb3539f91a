"""The fast path's GET depth: a batch deeper than ``get_depth`` is sent a few GETs at a time.

What a user needs from it: every block of the batch comes back byte-exact,
a missing or damaged block in the middle of the batch is a miss without
shifting the replies of the blocks after it, and one connection never has
more than ``get_depth`` GETs unanswered (deeper pipelines made redis-server
build replies in fresh memory faster than we read them: 0.73x of
redis-benchmark instead of 1.0-1.3x at ``pipeline_batch`` 8).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

import numpy as np
import pytest
from vllm.v1.kv_offload.base import LookupResult

from kvstore_tiers.admin.harness import make_keys

from ...conftest import rows_like as random_rows
from ...servers import RedisServer

HIT, MISS = LookupResult.HIT, LookupResult.MISS
ROW = 64 << 10


def _spy_on_outstanding_gets(fast: Any) -> dict[int, int]:
    """Record, per thread, the most GETs sent but not yet read back at a reply read."""
    sent: dict[int, int] = defaultdict(int)
    read: dict[int, int] = defaultdict(int)
    worst: dict[int, int] = defaultdict(int)
    get_connection, read_value = fast.pool.get_connection, fast._read_value

    def spying_connection(*a: Any, **kw: Any) -> Any:
        conn = get_connection(*a, **kw)
        if not getattr(conn, "_depth_spy", False):
            send = conn.send_packed_command

            def counting_send(cmds: Any, *a2: Any, **kw2: Any) -> Any:
                sent[threading.get_ident()] += sum(bytes(c).count(b"\r\nGET\r\n") for c in cmds)
                return send(cmds, *a2, **kw2)

            conn.send_packed_command = counting_send
            conn._depth_spy = True
        return conn

    def counting_read(*a: Any) -> Any:
        me = threading.get_ident()
        worst[me] = max(worst[me], sent[me] - read[me])
        read[me] += 1
        return read_value(*a)

    fast.pool.get_connection = spying_connection
    fast._read_value = counting_read
    return worst


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_a_batch_deeper_than_the_get_depth_loads_exact_bytes_and_misses_in_place(
        redis_server: RedisServer, harness_factory: Any, depth: int) -> None:
    h = harness_factory([{"type": "redis", "url": redis_server.url, "compression": "none",
                          "pipeline_batch": 8, "n_read_threads": 1, "n_write_threads": 1,
                          "presence_capacity": 0}], num_chunks=32, chunk_bytes=ROW)
    tier = h.tiers[0]
    keys, rows = make_keys(12, seed=21), random_rows(12, ROW, seed=21)
    h.store_all(keys, rows)
    names = [f"kvstore:{tier.namespace.object_name(k)}" for k in keys]
    with redis_server.client() as c:
        c.delete(names[3])  # evicted by Redis in between: a miss
        value = c.get(names[6])
        c.set(names[6], value[:-1000])  # truncated: a miss, and the stream must stay aligned
    fast = tier.backend._fast
    fast.get_depth = depth
    worst = _spy_on_outstanding_gets(fast)

    h.forget_primary()
    ctx = h.new_request()
    results, _ = h.lookup_until_resolved(keys, ctx)
    loaded_ok = [i for i in range(12) if i not in (3, 6)]
    assert [i for i, r in enumerate(results) if r == HIT] == loaded_ok
    assert np.array_equal(h.load([keys[i] for i in loaded_ok], ctx), rows[loaded_ok])
    h.finish_request(ctx)
    assert tier.counters.corrupt_objects == 1  # the truncated value, rejected on load
    assert tier.counters.load_failures == 0
    assert worst and max(worst.values()) <= depth


@pytest.mark.parametrize(("row", "expected"), [(64 << 10, 8), (1 << 20, 3)])
def test_a_near_server_gets_at_most_its_window_of_values_at_once(
        redis_server: RedisServer, harness_factory: Any, monkeypatch: pytest.MonkeyPatch,
        row: int, expected: int) -> None:
    """Near (get_depth None): a pipeline of small values goes whole, one of 1 MiB values
    keeps no more than NEAR_WINDOW_BYTES (4 MiB: 3 frames of a little over 1 MiB)
    unanswered, never fewer than GET_DEPTH."""
    from kvstore_tiers.backends.redis import fastio

    monkeypatch.setattr(fastio, "FAR_S", 0.5)  # loopback on a busy machine answers late
    h = harness_factory([{"type": "redis", "url": redis_server.url, "compression": "none",
                          "pipeline_batch": 8, "n_read_threads": 1, "n_write_threads": 1,
                          "presence_capacity": 0}], num_chunks=8, chunk_bytes=row)
    keys, rows = make_keys(8, seed=23), random_rows(8, row, seed=23)
    h.store_all(keys, rows)
    fast = h.tiers[0].backend._fast
    assert fast.get_depth is None
    worst = _spy_on_outstanding_gets(fast)
    h.forget_primary()
    ctx = h.new_request()
    results, _ = h.lookup_until_resolved(keys, ctx)
    assert results == [HIT] * 8
    assert np.array_equal(h.load(keys, ctx), rows)
    h.finish_request(ctx)
    assert not fast.far and max(worst.values()) == expected
