"""Our tier metrics reach Prometheus through vLLM's own offloading metrics path.

A real vLLM TieringOffloadingManager with our fs tier stores and loads blocks
(one of them corrupt); its ``get_stats()`` (which aggregates the primary's,
the manager's and every tier's stats, as the scheduler's stats path does) is
fed to vLLM's ``OffloadPromMetrics.observe`` -- the frontend's Prometheus
logger for the OffloadingConnector, built from
``TieringOffloadingSpec.build_metric_definitions`` -- and the text exposition
of a private prometheus_client registry is read back.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .conftest import ROW, flip_byte, kvf_files


def _prom_metrics(extra_config: dict[str, Any]) -> tuple[Any, CollectorRegistry]:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadPromMetrics,
    )

    reg = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=reg) for cls in (Counter, Gauge, Histogram)}
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra_config))
    prom = OffloadPromMetrics(vllm_config, types, ["model_name", "engine"],  # type: ignore[arg-type]
                              {0: ["org/model", "0"]})
    return prom, reg


def _value(text: str, name: str, **labels: str) -> float:
    """The sample ``name{labels...}`` of a text exposition (labels: a subset)."""
    for line in text.splitlines():
        m = re.match(r"^([^{\s]+)\{([^}]*)\}\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    raise AssertionError(f"no sample {name}{labels} in:\n{text}")


def test_tier_metrics_in_vllm_prometheus_output(
        tmp_path: Path, harness_factory: Callable[..., Any]) -> None:
    from kvstore_tiers.admin.harness import make_keys

    tier = {"type": "fs", "root_dir": str(tmp_path / "kv")}
    n = 6
    h = harness_factory([tier], num_chunks=n, chunk_bytes=ROW)
    prom, reg = _prom_metrics({"spec_name": "TieringOffloadingSpec",
                               "cpu_bytes_to_use": n * ROW, "secondary_tiers": [tier]})

    keys = make_keys(n, seed=3)
    rows = np.random.default_rng(3).integers(0, 256, (n, ROW), dtype=np.uint8)
    h.store_all(keys, rows)
    prom.observe(h.manager.get_stats().data)  # first scrape interval: the stores

    flip_byte(kvf_files(tmp_path / "kv")[0])
    h.forget_primary()
    h.tiers[0].presence = type(h.tiers[0].presence)(1000)  # as a new engine: no memory
    ctx2 = h.new_request()
    h.lookup_until_resolved(keys, ctx2)
    h.settle()
    h.finish_request(ctx2)
    prom.observe(h.manager.get_stats().data)  # second interval: the loads

    text = generate_latest(reg).decode()
    lab = {"kvstore_tier": "fs", "model_name": "org/model", "engine": "0"}
    c = h.tiers[0].counters
    assert c.objects_stored == n and c.corrupt_objects == 1 and c.objects_loaded == n - 1
    assert _value(text, "vllm:kvstore_objects_stored_total", **lab) == n
    assert _value(text, "vllm:kvstore_raw_bytes_written_total", **lab) == n * ROW
    stored = _value(text, "vllm:kvstore_stored_bytes_written_total", **lab)
    assert stored == c.stored_bytes_written == n * (ROW + 4096)  # fs: one 4 KiB header page
    assert _value(text, "vllm:kvstore_objects_loaded_total", **lab) == n - 1
    assert _value(text, "vllm:kvstore_raw_bytes_read_total", **lab) == (n - 1) * ROW
    assert _value(text, "vllm:kvstore_corrupt_objects_total", **lab) == 1
    # Zero counters exist as series from the first scrape (alerts see 0, not "no data").
    assert _value(text, "vllm:kvstore_stores_dropped_total", **lab) == 0
    assert _value(text, "vllm:kvstore_objects_evicted_total", **lab) == 0
    assert _value(text, "vllm:kvstore_healthy", **lab) == 1
    assert _value(text, "vllm:kvstore_circuit_state", **lab) == 0
    assert _value(text, "vllm:kvstore_store_seconds_count", **lab) >= 1
    assert _value(text, "vllm:kvstore_load_seconds_count", **lab) >= 1
    # Counters are handed over as increases: a third scrape with no traffic adds nothing.
    prom.observe(h.manager.get_stats().data)
    text2 = generate_latest(reg).decode()
    assert _value(text2, "vllm:kvstore_objects_stored_total", **lab) == n
    # vLLM's own per-tier series are there too, next to ours.
    assert 'tier="1:fs"' in text


def test_histograms_are_series_before_the_first_job(
        tmp_path: Path, harness_factory: Callable[..., Any]) -> None:
    """A fresh tier's first collection publishes every histogram with zero counts, so a
    new engine's p99 panels are not "no data"; the first job then counts once."""
    from kvstore_tiers.admin.harness import make_keys
    from kvstore_tiers.metrics import HISTOGRAMS, PREFIX

    tier = {"type": "fs", "root_dir": str(tmp_path / "kv")}
    h = harness_factory([tier], num_chunks=4, chunk_bytes=ROW)
    prom, reg = _prom_metrics({"spec_name": "TieringOffloadingSpec",
                               "cpu_bytes_to_use": 4 * ROW, "secondary_tiers": [tier]})
    prom.observe(h.manager.get_stats().data)  # the first scrape interval: no job yet

    text = generate_latest(reg).decode()
    lab = {"kvstore_tier": "fs", "model_name": "org/model", "engine": "0"}
    for name, (_, buckets) in HISTOGRAMS.items():
        metric = PREFIX + name
        assert _value(text, metric + "_count", **lab) == 0
        assert _value(text, metric + "_sum", **lab) == 0
        for le in [str(float(b)) for b in buckets] + ["+Inf"]:
            assert _value(text, metric + "_bucket", le=le, **lab) == 0

    keys = make_keys(2, seed=5)
    h.store_all(keys, np.random.default_rng(5).integers(0, 256, (2, ROW), dtype=np.uint8))
    prom.observe(h.manager.get_stats().data)
    text = generate_latest(reg).decode()
    assert _value(text, PREFIX + "store_seconds_count", **lab) == 1  # one store job
    assert _value(text, PREFIX + "load_seconds_count", **lab) == 0
