"""Counters a tier keeps, and their Prometheus definitions for vLLM.

Counts are added on the scheduler thread only (from finished jobs), so they
need no lock. :class:`TierCounters` is cumulative for the process (the CLI,
tests and the stats file read it); :meth:`TierMetrics.collect` hands vLLM the
increase since its last call, as ``get_stats`` requires.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

PREFIX = "vllm:kvstore_"
LABELS = ("kvstore_tier",)

# name -> (kind, documentation)
COUNTERS: dict[str, str] = {
    "objects_stored": "Objects written to the backend.",
    "objects_skipped": "Store requests skipped because the object already existed.",
    "objects_loaded": "Objects loaded (verified) into the primary tier.",
    "raw_bytes_written": "Raw KV bytes stored (before compression).",
    "stored_bytes_written": "Bytes sent to the backend (frames, after compression).",
    "raw_bytes_read": "Raw KV bytes loaded into the primary tier.",
    "stored_bytes_read": "Bytes received from the backend.",
    "load_misses": "Loads of objects that were gone (evicted or expired since lookup).",
    "corrupt_objects": "Objects rejected by frame or checksum validation (then removed).",
    "store_failures": "Objects whose store failed with a backend error.",
    "load_failures": "Objects whose load failed with a backend error.",
    "stores_dropped": "Objects not stored because the tier was unhealthy or its queue full.",
    "stores_dropped_backpressure": "Objects not stored because the tier's stores in flight "
                                   "were at max_store_bytes_in_flight (backpressure).",
    "stores_not_admitted_rare": "Objects not stored by admission: seen fewer than "
                                "admission_min_sightings times (admission: reuse).",
    "stores_not_admitted_cold": "Objects not stored by admission: the tier was full and "
                                "they were seen less often than what they would displace "
                                "(admission: adaptive).",
    "transfers_cancelled": "Objects whose store or load was cancelled before it started "
                           "(drain_jobs: reset_cache, sleep, shutdown).",
    "objects_evicted": "Objects removed by the tier's capacity control.",
    "read_through_stored": "Objects written here by read-through: blocks promoted from a "
                           "tier listed after this one (also in objects_stored).",
    "read_through_dropped": "Blocks promoted from a later tier and not cached here: the "
                            "blocks waiting held read_through_max_bytes, the queue was full, "
                            "or vLLM reused the row before the fill read it.",
}
GAUGES: dict[str, str] = {
    "healthy": "1 while the backend is healthy (circuit closed), 0 otherwise.",
    "circuit_state": "Circuit breaker state: 0 closed, 1 half-open, 2 open.",
    "queued_chunks": "Chunks queued in the tier's I/O pool.",
    "store_bytes_in_flight": "Bytes of store jobs submitted and not yet finished "
                             "(bounded by max_store_bytes_in_flight).",
}
HISTOGRAMS: dict[str, tuple[str, tuple[float, ...]]] = {
    "store_seconds": (
        "Store job duration, submit to completion, per job.",
        (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
    ),
    "load_seconds": (
        "Load job duration, submit to completion, per job.",
        (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
    ),
}


@dataclass
class TierCounters:
    objects_stored: int = 0
    objects_skipped: int = 0
    objects_loaded: int = 0
    raw_bytes_written: int = 0
    stored_bytes_written: int = 0
    raw_bytes_read: int = 0
    stored_bytes_read: int = 0
    load_misses: int = 0
    corrupt_objects: int = 0
    store_failures: int = 0
    load_failures: int = 0
    stores_dropped: int = 0
    stores_dropped_backpressure: int = 0
    stores_not_admitted_rare: int = 0
    stores_not_admitted_cold: int = 0
    transfers_cancelled: int = 0
    objects_evicted: int = 0
    read_through_stored: int = 0
    read_through_dropped: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def metric_definitions() -> dict[str, Any]:
    """The OffloadingMetricMetadata of every metric a kvstore tier emits (pure)."""
    from vllm.v1.kv_offload.base import (
        OffloadingCounterMetadata,
        OffloadingGaugeMetadata,
        OffloadingHistogramMetadata,
    )

    defs: dict[str, Any] = {}
    for name, doc in COUNTERS.items():
        defs[PREFIX + name] = OffloadingCounterMetadata(documentation=doc, labelnames=LABELS)
    for name, doc in GAUGES.items():
        defs[PREFIX + name] = OffloadingGaugeMetadata(documentation=doc, labelnames=LABELS)
    for name, (doc, buckets) in HISTOGRAMS.items():
        defs[PREFIX + name] = OffloadingHistogramMetadata(
            documentation=doc, labelnames=LABELS, buckets=buckets
        )
    return defs


@dataclass
class TierMetrics:
    """Cumulative counters plus what vLLM has not collected yet."""

    label: str
    counters: TierCounters = field(default_factory=TierCounters)
    _reported: dict[str, int] = field(default_factory=dict)
    _observations: list[tuple[str, float]] = field(default_factory=list)

    def observe(self, histogram: str, value: float) -> None:
        if len(self._observations) < 100_000:  # bounded if nobody collects
            self._observations.append((histogram, value))

    def collect(self, gauges: dict[str, float]) -> Any | None:
        """Build vLLM's OffloadingConnectorStats with the increase since the last call."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            OffloadingConnectorStats,
        )

        from kvstore_tiers.compat import declare_histogram

        stats = OffloadingConnectorStats()
        labels = (self.label,)
        if not self._reported:
            # As the counters below: every histogram is a series from the first
            # collection (zero buckets), so a p99 panel is not "no data" before the
            # tier's first load.
            for name in HISTOGRAMS:
                declare_histogram(stats, PREFIX + name, labels)
        for name, value in self.counters.as_dict().items():
            # The first collection reports every counter, zeros included, so each
            # series exists in Prometheus from the start: an alert on, e.g.,
            # rate(stores_dropped) then sees 0 rather than "no data".
            first = name not in self._reported
            delta = value - self._reported.get(name, 0)
            if delta or first:
                stats.increase_counter(PREFIX + name, delta, labels)
                self._reported[name] = value
        for name, value in gauges.items():
            stats.set_gauge(PREFIX + name, value, labels)
        for name, value in self._observations:
            stats.observe_histogram(PREFIX + name, value, labels)
        self._observations.clear()
        return stats
