"""What differs between the vLLM versions we support (0.32, 0.33).

Everything version-dependent that a tier touches is imported or probed here
once, so the rest of the package is written against one API.
"""

from __future__ import annotations

import inspect
from typing import Any


def detector_accepts_failure_threshold() -> bool:
    """0.33's EMABackpressureDetector takes ``failure_threshold``; 0.32's raises on it."""
    try:
        from vllm.v1.kv_offload.tiering.backpressure import EMABackpressureDetector

        return "failure_threshold" in inspect.signature(EMABackpressureDetector).parameters
    except Exception:
        return False


def make_default_remote_detector(tier_type: str, failure_threshold: int) -> Any | None:
    """An EMA backpressure detector with network water marks for a remote tier.

    vLLM's defaults are keyed on the type string ("fs"/"obj" get a failure
    threshold, "s3"/"redis" do not), so remote tiers that were given no
    ``backpressure`` dict get this one. Where vLLM feeds it failed stores
    (0.33), it is a :class:`~kvstore_tiers.backpressure.BreakerCountedDetector`
    with ``failure_threshold``. None if vLLM has no such class.
    """
    try:
        from vllm.v1.kv_offload.tiering.backpressure import EMABackpressureDetector
    except Exception:
        return None
    kwargs: dict[str, Any] = dict(EMABackpressureDetector.default_config("obj", locality="REMOTE"))
    if not detector_accepts_failure_threshold():
        kwargs.pop("failure_threshold", None)
        return EMABackpressureDetector(**kwargs)
    from kvstore_tiers.backpressure import BreakerCountedDetector

    kwargs["failure_threshold"] = failure_threshold
    return BreakerCountedDetector(**kwargs)


def declare_histogram(stats: Any, name: str, labelvalues: tuple[str, ...]) -> None:
    """Put histogram ``name{labelvalues}`` into ``stats`` without an observation.

    vLLM's Prometheus logger (``OffloadPromMetrics.observe``) binds the
    labelled child of every (name, labels) in the payload before observing
    its samples, so an empty sample list publishes the series: every bucket,
    ``_sum`` and ``_count`` at 0, before the first job. An
    ``OffloadingConnectorStats`` has no public call that adds a series
    without a sample, so this writes its payload layout (a type per name, a
    sample list per label tuple) with vLLM's own keys. Never raises: where
    the layout differs, nothing is added and the series appears with its
    first observation.
    """
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            _MetricType,
            _StatsKey,
        )

        types, values = stats.data[_StatsKey.TYPES], stats.data[_StatsKey.DATA]
        if types.setdefault(name, _MetricType.HISTOGRAM) == _MetricType.HISTOGRAM:
            values.setdefault(name, {}).setdefault(labelvalues, [])
    except Exception:
        return


def secondary_tiers(offloading_spec: Any) -> list[Any] | None:
    """The secondary tiers vLLM's ``TieringOffloadingSpec`` built, in
    ``secondary_tiers`` order, once its manager exists (0.32 and 0.33 keep it
    in ``_manager``); None for a spec that built none (a test's stand-in)."""
    tiers = getattr(getattr(offloading_spec, "_manager", None), "secondary_tiers", None)
    return list(tiers) if isinstance(tiers, list | tuple) else None


def secondary_tier_configs(offloading_spec: Any) -> list[Any]:
    """The ``secondary_tiers`` configs of the spec, in order ([] for a stand-in)."""
    configs = getattr(offloading_spec, "secondary_tier_configs", None)
    return list(configs) if isinstance(configs, list | tuple) else []
