"""A remote tier at network distance (a real server behind the delaying proxy of
kvstore_tiers.tools.netem): the scheduler thread's calls return without waiting for
the network. A lookup of a block this engine does not know answers RETRY at once and
its verdict (HIT) comes on a later step, after the round trips; a store's submission
returns before its PUT/SET reached the server."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import LookupResult

from kvstore_tiers.admin.harness import make_keys, rows_for
from kvstore_tiers.tools.netem.delay import delay_proxy

RTT_MS = 200
ROW = 64 << 10
#: What a scheduler-thread call may take on a busy 2-core machine: far below one RTT.
CALL_S = RTT_MS / 1e3 / 4


def _behind_proxy(url: str, host: str, port: int) -> str:
    parts = urlsplit(url)
    return parts._replace(netloc=f"{host}:{port}").geturl()


def _check(harness_factory: Callable[..., Any], direct: dict[str, Any],
           far: Callable[[str], dict[str, Any]], url: str) -> None:
    keys, rows = make_keys(4, seed=52), rows_for(make_keys(4, seed=52), ROW)
    harness_factory([direct], chunk_bytes=ROW).store_all(keys, rows)
    host, port = urlsplit(url).hostname, urlsplit(url).port
    assert host and port
    with delay_proxy((host, port), RTT_MS) as (phost, pport):
        h = harness_factory([far(_behind_proxy(url, phost, pport))], chunk_bytes=ROW)
        tier = h.tiers[0]
        ctx = h.new_request()
        t0 = time.monotonic()
        with h.locked():
            first = tier.lookup(keys[0], ctx)
        took = time.monotonic() - t0
        assert first == LookupResult.RETRY
        assert took < CALL_S, f"lookup at {RTT_MS} ms RTT blocked for {took:.3f} s"
        # Every later call returns at once too, until the verdict arrives.
        slowest, verdict_at = 0.0, None
        deadline = t0 + 30
        while time.monotonic() < deadline:
            h.step()
            s = time.monotonic()
            with h.locked():
                r = tier.lookup(keys[0], ctx)
            slowest = max(slowest, time.monotonic() - s)
            if r != LookupResult.RETRY:
                verdict_at = time.monotonic() - t0
                break
            time.sleep(0.002)
        assert r == LookupResult.HIT
        assert verdict_at is not None and verdict_at >= RTT_MS / 1e3  # it went to the server
        assert slowest < CALL_S, slowest
        results, _ = h.lookup_until_resolved(keys, ctx)
        assert results == [LookupResult.HIT] * 4
        assert np.array_equal(h.load(keys, ctx), rows)
        h.finish_request(ctx)
        # A store's submission returns before its first byte reached the server.
        new_keys = make_keys(4, seed=53)
        t0 = time.monotonic()
        sctx = h.store(new_keys, rows_for(new_keys, ROW))
        took = time.monotonic() - t0
        assert took < CALL_S, f"a store's submission at {RTT_MS} ms RTT took {took:.3f} s"
        h.settle(timeout_s=60)
        h.finish_request(sctx)
        assert tier.counters.objects_stored == 4


def test_s3_lookup_at_distance_never_blocks_the_scheduler(
        harness_factory: Callable[..., Any], tier_config: Callable[..., dict[str, Any]],
        moto_endpoint: str) -> None:
    _check(harness_factory, tier_config(),
           lambda url: tier_config(endpoint_url=url, read_timeout_s=10.0,
                                   connect_timeout_s=5.0), moto_endpoint)


def test_redis_lookup_at_distance_never_blocks_the_scheduler(
        harness_factory: Callable[..., Any], redis_server: Any) -> None:
    cfg = {"type": "redis", "key_prefix": "dist:", "url": redis_server.url}
    _check(harness_factory, cfg, lambda url: {**cfg, "url": url, "socket_timeout_s": 10.0,
                                              "connect_timeout_s": 5.0}, redis_server.url)
