"""Start-up builds the async client's HEAD path with one HEAD of an absent key, so a fresh
engine's first lookup does not pay it (hundreds of ms of botocore set-up on this machine, more
than the round trips at 50 ms), then opens the pool's connections with as many HEADs at once,
so a fresh engine's first wave of existence checks opens none (each new one would cost a round
trip more at distance); none is counted among the data path's requests."""

from __future__ import annotations

from typing import Any

from kvstore_tiers.backends.s3.backend import WARM_KEY

from ...faults.faultproxy import FaultProxy
from .s3_helpers import harness


def test_start_up_heads_the_warm_key_once_per_pooled_connection(tier_config: Any,
                                                                proxy: FaultProxy) -> None:
    h = harness(tier_config(endpoint_url=proxy.url, max_concurrency=8))
    try:
        backend = h.tiers[0].backend
        warm = [m for m, p in proxy.seen if p.endswith("/" + backend.prefix + WARM_KEY)]
        assert warm == ["HEAD"] * 9, proxy.seen  # the first alone, then 8 at once
        assert backend.requests["HeadObject"] == 0
    finally:
        h.shutdown()


def test_a_fresh_engine_s_first_existence_checks_open_no_connection(
        tier_config: Any, proxy: FaultProxy) -> None:
    """The proxy keeps its client connections open whatever the server behind it does."""
    h = harness(tier_config(endpoint_url=proxy.url, max_concurrency=8))
    try:
        backend = h.tiers[0].backend
        opened = proxy.connections
        assert backend.exists_many([f"absent-{i}" for i in range(8)]) == [False] * 8
        assert backend.requests["HeadObject"] == 8
        assert proxy.connections == opened
    finally:
        h.shutdown()
