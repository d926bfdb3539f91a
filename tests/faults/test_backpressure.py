"""Remote tiers get a backpressure detector with network water marks by default."""

from __future__ import annotations

from typing import Any

from kvstore_tiers.compat import detector_accepts_failure_threshold

from .common import Driver


def test_remote_tier_without_backpressure_dict_gets_network_detector(
    redis_server_factory: Any,
) -> None:
    from vllm.v1.kv_offload.tiering.backpressure import EMABackpressureDetector

    srv = redis_server_factory()
    d = Driver("redis", [{"type": "redis", "url": srv.url, "failure_threshold": 4}])
    try:
        det = d.tier._bp_detector
        assert isinstance(det, EMABackpressureDetector)
        net = EMABackpressureDetector.default_config("obj", locality="REMOTE")
        assert det._high == net["high_water_s"] and det._low == net["low_water_s"]
        if detector_accepts_failure_threshold():  # vLLM 0.33; 0.32 has no such kwarg
            assert getattr(det, "_failure_threshold", 4) == 4
    finally:
        assert d.close() == 0
