"""Backpressure: remote tiers get vLLM's detector with network water marks by
default, and every tier bounds its unfinished stores (``max_store_bytes_in_flight``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvstore_tiers.admin.harness import make_keys
from kvstore_tiers.compat import detector_accepts_failure_threshold

from .common import HIT, MISS, Driver, rows_for
from .stall import StallFsBackend


def test_remote_tier_without_backpressure_dict_gets_network_detector(
    redis_server_factory: Any,
) -> None:
    from vllm.v1.kv_offload.tiering.backpressure import EMABackpressureDetector

    srv = redis_server_factory()
    d = Driver("redis", [{"type": "redis", "url": srv.url, "failure_threshold": 4}])
    try:
        det = d.tier.bp_detector
        assert isinstance(det, EMABackpressureDetector)
        net = EMABackpressureDetector.default_config("obj", locality="REMOTE")
        assert det._high == net["high_water_s"] and det._low == net["low_water_s"]
        if detector_accepts_failure_threshold():  # vLLM 0.33; 0.32 has no such kwarg
            assert getattr(det, "_failure_threshold", 4) == 4
    finally:
        assert d.close() == 0


# -- max_store_bytes_in_flight: a tier that cannot keep up drops stores ------------------
ROW = 16384  # Driver's chunk bytes


def _stalled_fs(tmp_path: Path, **keys: Any) -> Driver:
    StallFsBackend.store_gate.clear()
    StallFsBackend.store_stalled.clear()
    return Driver("fs", [{"type": "StallFsTier", "module_path": "tests.faults.stall",
                          "root_dir": str(tmp_path), **keys}], num_chunks=16)


def _cascade(d: Driver, keys: list[bytes]) -> Any:
    """A request computes ``keys``; vLLM stores them in the primary and cascades them."""
    ctx = d.h.new_request()
    d.h.store(keys, rows_for(keys, ROW), ctx)
    d.h.step()
    return ctx


def _pinned(d: Driver) -> int:
    """Primary rows neither free nor evictable: held by unfinished jobs."""
    p = d.h.manager.primary_tier
    return p._num_chunks - p._get_num_free_chunks() - p._num_evictable_cache_chunks


def test_stores_past_the_bound_are_dropped_not_queued(tmp_path: Path) -> None:
    d = _stalled_fs(tmp_path, max_store_bytes_in_flight=4 * ROW)
    try:
        tier = d.tier
        first, second = make_keys(4, seed=1), make_keys(4, seed=2)
        ctx1 = _cascade(d, first)  # nothing in flight: queued (and stuck in the backend)
        assert StallFsBackend.store_stalled.wait(10)
        ctx2 = _cascade(d, second)  # would exceed the bound: dropped
        c = tier.counters
        assert c.stores_dropped_backpressure == 4
        assert tier.gauges()["store_bytes_in_flight"] == 4 * ROW
        assert tier.get_stats() is not None
        d.h.step()
        # The dropped job was reported at once: only the stuck job pins rows.
        assert _pinned(d) == 4
        assert c.store_failures == 0 and c.stores_dropped == 0
        StallFsBackend.store_gate.set()
        d.settle()
        assert tier.gauges()["store_bytes_in_flight"] == 0
        assert c.objects_stored == 4
        for ctx in (ctx1, ctx2):
            d.h.finish_request(ctx)
        d.forget_primary()
        for k in first:
            d.expected[k] = rows_for([k], ROW)[0].tobytes()
        assert d.fetch(first) == [HIT] * 4
        assert d.fetch(second)[0] == MISS  # never stored; vLLM recomputes
        third = make_keys(2, seed=3)  # the tier caught up: stores go through again
        d.store(third, rows_for(third, ROW))
        assert c.objects_stored == 6 and c.stores_dropped_backpressure == 4
    finally:
        StallFsBackend.store_gate.set()
        assert d.close() == 0
    assert d.score.wrong_bytes == 0 and d.score.exceptions == 0


def test_an_idle_tier_takes_a_job_larger_than_the_bound(tmp_path: Path) -> None:
    d = _stalled_fs(tmp_path, max_store_bytes_in_flight=ROW)
    StallFsBackend.store_gate.set()
    try:
        keys = make_keys(6, seed=4)
        d.store(keys, rows_for(keys, ROW))
        assert d.tier.counters.objects_stored == 6
        assert d.tier.counters.stores_dropped_backpressure == 0
    finally:
        assert d.close() == 0


@pytest.mark.parametrize("bound, dropped", [(None, 4), (0, 0)])
def test_default_bound_is_half_the_primary_and_zero_is_none(
        tmp_path: Path, bound: int | None, dropped: int) -> None:
    keys = {} if bound is None else {"max_store_bytes_in_flight": bound}
    d = _stalled_fs(tmp_path, **keys)
    try:
        ctxs = [_cascade(d, make_keys(4, seed=10 + i)) for i in range(3)]  # 12 of 16 rows
        assert d.tier.counters.stores_dropped_backpressure == dropped
        StallFsBackend.store_gate.set()
        d.settle()
        for ctx in ctxs:
            d.h.finish_request(ctx)
        assert d.tier.counters.objects_stored == 12 - dropped
    finally:
        StallFsBackend.store_gate.set()
        assert d.close() == 0


@pytest.mark.parametrize("bound", [None, 0])
def test_a_stuck_store_backlog_does_not_starve_loads(tmp_path: Path, bound: int | None) -> None:
    """Loads need free primary rows. Without the bound, stores stuck in a slow
    backend pin the primary until no promotion can get a row; with it (the
    default), the loads of blocks already in the tier are served meanwhile."""
    keys = {} if bound is None else {"max_store_bytes_in_flight": bound}
    d = _stalled_fs(tmp_path, **keys)
    StallFsBackend.store_gate.set()
    try:
        hot = make_keys(4, seed=20)
        d.store(hot, rows_for(hot, ROW))  # in the tier before the backend slows down
        d.forget_primary()
        StallFsBackend.store_gate.clear()
        ctxs = [_cascade(d, make_keys(4, seed=21 + i)) for i in range(4)]  # a store flood
        ctx = d.h.new_request()
        results, _ = d.h.lookup_until_resolved(hot, ctx)
        if bound is None:
            assert results == [HIT] * 4
            loaded = d.h.load(hot, ctx)
            assert [r.tobytes() for r in loaded] == [r.tobytes() for r in rows_for(hot, ROW)]
            assert _pinned(d) <= 8  # at most half the primary: the default bound
        else:  # every row pinned by stuck stores: the promotions found no room
            assert results == [MISS] * 4
            assert _pinned(d) == 16
        StallFsBackend.store_gate.set()
        d.settle()
        for c in [*ctxs, ctx]:
            d.h.finish_request(c)
        assert d.tier.counters.objects_loaded == (4 if bound is None else 0)
    finally:
        StallFsBackend.store_gate.set()
        assert d.close() == 0
    assert d.score.wrong_bytes == 0 and d.score.exceptions == 0
