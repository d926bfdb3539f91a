"""Start-up builds the async client's HEAD path with one HEAD of an absent key, so a fresh
engine's first lookup does not pay it (hundreds of ms of botocore set-up on this machine, more
than the round trips at 50 ms); that HEAD is not counted among the data path's requests."""

from __future__ import annotations

from typing import Any

from kvstore_tiers.backends.s3.backend import WARM_KEY

from ...faults.faultproxy import FaultProxy
from .s3_helpers import harness


def test_start_up_sends_one_head_of_the_warm_key(tier_config: Any, proxy: FaultProxy
                                                 ) -> None:
    h = harness(tier_config(endpoint_url=proxy.url))
    try:
        backend = h.tiers[0].backend
        warm = [m for m, p in proxy.seen if p.endswith("/" + backend.prefix + WARM_KEY)]
        assert warm == ["HEAD"], proxy.seen
        assert backend.requests["HeadObject"] == 0
    finally:
        h.shutdown()
