"""Store admission through vLLM's real manager: what vLLM sees stays exactly right.

A block the policy does not admit is simply not in the tier: its job reports
success, its rows are released with the job, a later lookup misses, and the
counters say how many were skipped and why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm.v1.kv_offload.base import LookupResult

from kvstore_tiers.tools.harness import make_keys

from ..conftest import rows_like

ROW = 4096
HIT, MISS = LookupResult.HIT, LookupResult.MISS


def _record(tier: Any) -> list[tuple[int, bool]]:
    """What the tier reports to vLLM, unchanged."""
    reported: list[tuple[int, bool]] = []
    finished = tier.get_finished_jobs

    def record() -> list[Any]:
        out = list(finished())
        reported.extend((r.job_id, r.success) for r in out)
        return out

    tier.get_finished_jobs = record
    return reported


def _rows_released(h: Any) -> bool:
    p = h.manager.primary_tier
    return not h.manager._jobs and (
        p._get_num_free_chunks() + p._num_evictable_cache_chunks == p._num_chunks)


def _objects(root: Path) -> int:
    return sum(1 for _ in root.rglob("*.kvf"))


def _lookup(h: Any, keys: list[bytes]) -> list[LookupResult]:
    ctx = h.new_request()
    results = h.lookup_until_resolved(keys, ctx)[0]
    h.finish_request(ctx)
    return results


def test_reuse_skips_first_sightings_reports_success_and_misses_later(
        harness_factory, tmp_path) -> None:
    h = harness_factory([{"type": "fs", "root_dir": str(tmp_path), "admission": "reuse"}],
                        num_chunks=16, chunk_bytes=ROW)
    tier = h.tiers[0]
    reported = _record(tier)
    once, twice = make_keys(4, seed=1), make_keys(4, seed=2)
    h.store_all(twice, rows_like(4, ROW))
    h.forget_primary()
    c = tier.counters
    assert reported == [(reported[0][0], True)]  # nothing admitted: success at once
    assert c.stores_not_admitted_rare == 4 and c.objects_stored == 0
    assert _objects(tmp_path) == 0 and _rows_released(h)
    assert _lookup(h, twice) == [MISS] * 4

    # One job with both: the blocks seen before are written, the others not.
    h.store_all(once[:2] + twice + once[2:], rows_like(8, ROW, seed=3))
    h.forget_primary()
    assert [ok for _, ok in reported] == [True, True]
    assert c.stores_not_admitted_rare == 8 and c.objects_stored == 4
    assert c.store_failures == 0 and c.stores_dropped == 0
    assert _objects(tmp_path) == 4 and _rows_released(h)
    assert _lookup(h, twice) == [HIT] * 4
    assert _lookup(h, once) == [MISS] * 4
    assert tier.get_stats() is not None


def test_loads_count_as_sightings(harness_factory, tmp_path) -> None:
    h = harness_factory([{"type": "fs", "root_dir": str(tmp_path), "admission": "reuse"}],
                        num_chunks=16, chunk_bytes=ROW)
    tier = h.tiers[0]
    keys = make_keys(3, seed=4)
    rows = rows_like(3, ROW)
    for _ in range(2):
        h.store_all(keys, rows)
        h.forget_primary()
    sketch = tier._admission.sketch
    before = [sketch.estimate(k) for k in keys]
    ctx = h.new_request()
    assert h.lookup_until_resolved(keys, ctx)[0] == [HIT] * 3
    assert (h.load(keys, ctx) == rows).all()
    h.settle()
    h.finish_request(ctx)
    assert [sketch.estimate(k) for k in keys] == [b + 1 for b in before]


def test_always_makes_no_admission_call(harness_factory, tmp_path) -> None:
    h = harness_factory([{"type": "fs", "root_dir": str(tmp_path)}], num_chunks=16,
                        chunk_bytes=ROW)
    tier = h.tiers[0]
    assert tier._admission is None
    h.store_all(make_keys(4, seed=5), rows_like(4, ROW))
    assert tier.counters.objects_stored == 4 and _objects(tmp_path) == 4


def test_adaptive_writes_everything_below_capacity_and_gates_when_full(
        harness_factory, tmp_path) -> None:
    """fs with a small max_bytes: 40 objects of 68 KiB on disk."""
    from ..backends.fs.test_fs_capacity import _overhead

    row = 65536
    cap = _overhead(tmp_path) + 40 * (row + 4096)
    h = harness_factory([{"type": "fs", "root_dir": str(tmp_path), "max_bytes": cap,
                          "admission": "adaptive"}], num_chunks=16, chunk_bytes=row)
    tier = h.tiers[0]
    policy = tier._admission
    policy.close()  # the test reads the capacity itself, at the points it checks
    reported = _record(tier)
    c = tier.counters
    for seed in range(7):  # 35 of 40: 87 % full, under the evictor's 95 % mark
        h.store_all(make_keys(5, seed=20 + seed), rows_like(5, row, seed=seed))
        h.forget_primary()
        if seed == 2:
            policy.signal.refresh()
            assert not policy.signal.full  # 15 of 40
    assert c.objects_stored == 35 and c.stores_not_admitted_cold == 0
    policy.signal.refresh()
    # About 40 blocks: the room max_bytes leaves beside the directory's own
    # bytes, as the controller counted them (the bound above is generous).
    assert policy.signal.full and 38 <= policy.signal.blocks <= 42 and policy.threshold == 2

    new = make_keys(4, seed=40)
    h.store_all(new, rows_like(4, row))
    h.forget_primary()
    assert c.stores_not_admitted_cold == 4 and c.objects_stored == 35
    assert reported[-1][1] and _rows_released(h)
    assert _lookup(h, new) == [MISS] * 4
    h.store_all(new, rows_like(4, row))  # seen before: more frequent than the victims
    h.forget_primary()
    assert c.objects_stored == 39 and c.stores_not_admitted_cold == 4
    assert all(ok for _, ok in reported) and _rows_released(h)
    assert _lookup(h, new) == [HIT] * 4


def test_adaptive_takes_the_write_cost_the_tier_is_given(harness_factory, tmp_path) -> None:
    from kvstore_tiers.admission import WRITE_COST

    costs = []
    for i, extra in enumerate(({}, {"admission_write_cost": 0.3})):
        h = harness_factory([{"type": "fs", "root_dir": str(tmp_path / str(i)),
                              "admission": "adaptive", **extra}], num_chunks=4, chunk_bytes=4096)
        costs.append(h.tiers[0]._admission.write_cost)
    assert costs == [WRITE_COST, 0.3]


def test_adaptive_holds_a_tier_that_evicted_lately_full(harness_factory, tmp_path) -> None:
    """fs evicting down to half its max_bytes: between rounds the tier holds less
    than the full fraction, and still counts as full (the next round comes)."""
    from ..backends.fs.test_fs_capacity import _overhead

    row = 65536
    cap = _overhead(tmp_path) + 40 * (row + 4096)
    h = harness_factory([{"type": "fs", "root_dir": str(tmp_path), "max_bytes": cap,
                          "high_watermark": 0.95, "low_watermark": 0.5,
                          "admission": "adaptive"}], num_chunks=16, chunk_bytes=row)
    tier = h.tiers[0]
    policy = tier._admission
    policy.close()  # the test reads the capacity itself
    for seed in range(9):  # 45 objects of room for 40: the evictor runs
        h.store_all(make_keys(5, seed=60 + seed), rows_like(5, row, seed=seed))
        h.forget_primary()
    tier.backend.capacity.evict_now(wait=True)
    assert tier.backend.evicted_for_capacity > 0
    policy.signal.refresh()
    sig = policy.signal
    assert sig.capacity is not None and sig.used < sig.FULL_FRACTION * sig.capacity
    assert sig.full
