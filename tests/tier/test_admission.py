"""Store admission through vLLM's real manager: what vLLM sees stays exactly right.

A block the policy does not admit is simply not in the tier: its job reports
success, its rows are released with the job, a later lookup misses, and the
counters say how many were skipped and why.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import LookupResult

from kvstore_tiers.admin.harness import make_keys
from kvstore_tiers.admission import policy_of

from ..conftest import rows_like
from .flaky import flaky_tier
from .jobs import results, submit_stores

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
    assert reported == [(reported[0][0], True)]  # nothing admitted: success
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
    sketch = policy_of(tier).sketch
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
    assert policy_of(tier) is None
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
    policy = policy_of(tier)
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
    from kvstore_tiers.config import WRITE_COST

    costs = []
    for i, extra in enumerate(({}, {"admission_write_cost": 0.3})):
        h = harness_factory([{"type": "fs", "root_dir": str(tmp_path / str(i)),
                              "admission": "adaptive", **extra}], num_chunks=4, chunk_bytes=4096)
        costs.append(policy_of(h.tiers[0]).write_cost)
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
    policy = policy_of(tier)
    policy.close()  # the test reads the capacity itself
    for seed in range(9):  # 45 objects of room for 40: the evictor runs
        h.store_all(make_keys(5, seed=60 + seed), rows_like(5, row, seed=seed))
        h.forget_primary()
    tier.backend.capacity.evict_now(wait=True)
    assert tier.backend.evictions.for_capacity > 0
    policy.signal.refresh()
    sig = policy.signal
    assert sig.capacity is not None and sig.used < sig.FULL_FRACTION * sig.capacity
    assert sig.full


def test_admission_is_decided_on_an_io_thread_never_the_schedulers(
        harness_factory, tmp_path) -> None:
    """The policy's one call per store job runs on the I/O thread that starts the
    job; vLLM's scheduler thread (here the test's) never makes it."""
    h = harness_factory([{"type": "fs", "root_dir": str(tmp_path), "admission": "reuse"}],
                        num_chunks=16, chunk_bytes=ROW)
    tier = h.tiers[0]
    callers = _record_policy_threads(tier)
    seen, new = make_keys(2, seed=6), make_keys(3, seed=7)
    policy_of(tier).seen(seen)  # sighted once before: the second offer admits them
    h.view[:5] = np.arange(5, dtype=np.uint8)[:, None]
    submit_stores(h, [(1, new[:1] + seen + new[1:], [0, 1, 2, 3, 4])])
    result = results(h, 1)[1]
    assert callers and all(name.startswith("kvstore_fs") for name in callers)
    assert threading.current_thread().name not in callers
    # Two of five admitted: success, and only their bytes moved.
    assert result.success and result.transfer_bytes == 2 * ROW
    c = tier.counters
    assert c.objects_stored == 2 and c.stores_not_admitted_rare == 3
    assert _objects(tmp_path) == 2
    # Not admitted: gone from the presence index, so a later store offers them again.
    assert all(k not in tier.presence for k in new) and all(k in tier.presence for k in seen)
    assert set(tier.presence) == set(seen)
    submit_stores(h, [(2, new, [0, 1, 2])])
    assert results(h, 1)[2].success
    assert c.objects_stored == 5 and c.stores_not_admitted_rare == 3 and c.objects_skipped == 0


def test_a_job_with_nothing_admitted_reports_no_bytes_and_no_time(
        harness_factory, tmp_path) -> None:
    """vLLM's backpressure detector ignores a store result of 0 bytes; it must not
    read one that wrote nothing as a store that took no time."""
    h = harness_factory([{"type": "fs", "root_dir": str(tmp_path), "admission": "reuse"}],
                        num_chunks=16, chunk_bytes=ROW)
    submit_stores(h, [(1, make_keys(4, seed=8), [0, 1, 2, 3])])
    result = results(h, 1)[1]
    assert result.success and result.transfer_bytes == 0 and result.transfer_time == 0.0
    assert h.tiers[0].counters.stores_not_admitted_rare == 4 and not h.tiers[0].presence
    # Nor is it a store's latency: the store_seconds histogram gets nothing.
    assert not [o for o in h.tiers[0].metrics._observations if o[0] == "store_seconds"]


def test_kv_events_name_only_the_admitted_blocks(harness_factory, tmp_path) -> None:
    h = harness_factory([{"type": "fs", "root_dir": str(tmp_path), "admission": "reuse",
                          "enable_kv_events": True}], num_chunks=16, chunk_bytes=ROW)
    tier = h.tiers[0]
    seen, new = make_keys(2, seed=9), make_keys(2, seed=10)
    policy_of(tier).seen(seen)
    h.store_all(seen + new, rows_like(4, ROW))
    events = list(tier.take_events())
    assert sorted(k for e in events for k in e.keys) == sorted(seen)
    assert not any(e.removed for e in events)


def test_a_policy_that_fails_admits_the_whole_job(harness_factory, tmp_path) -> None:
    """The fault injected: the policy raises. The job is written as with ``always``,
    and the tier stays usable."""
    h = harness_factory([{"type": "fs", "root_dir": str(tmp_path), "admission": "reuse"}],
                        num_chunks=16, chunk_bytes=ROW)
    tier = h.tiers[0]

    def broken_offer(*a: Any) -> Any:
        raise RuntimeError("policy bug")

    policy_of(tier).sketch.offer = broken_offer
    keys = make_keys(3, seed=11)
    h.store_all(keys, rows_like(3, ROW))
    c = tier.counters
    assert c.objects_stored == 3 and c.stores_not_admitted_rare == 0 and c.store_failures == 0
    assert _lookup(h, keys) == [HIT] * 3


def _record_policy_threads(tier: Any) -> list[str]:
    """The names of the threads that call the tier's admission policy, from now on."""
    sketch = policy_of(tier).sketch
    offer, callers = sketch.offer, []

    def recording_offer(keys: list[bytes], *a: Any) -> Any:
        callers.append(threading.current_thread().name)
        return offer(keys, *a)

    sketch.offer = recording_offer
    return callers


def test_a_job_cut_at_drain_asks_the_policy_nothing_and_is_cancelled_whole(
        harness_factory, tmp_path, flaky) -> None:
    """A queued job cut at drain (vLLM's scheduler thread, here the test's): the
    policy is not called there; every block of the job is reported cancelled (vLLM
    keeps them in the primary) and none stays in the presence index."""
    h = harness_factory([flaky_tier(tmp_path, n_write_threads=1, n_read_threads=1,
                                    admission="reuse")], num_chunks=16, chunk_bytes=ROW)
    tier = h.tiers[0]
    first, seen, new = make_keys(2, seed=12), make_keys(2, seed=13), make_keys(2, seed=14)
    policy_of(tier).seen(first + first + seen)
    callers = _record_policy_threads(tier)
    flaky.store_gate.clear()
    submit_stores(h, [(1, first, [0, 1])])
    assert flaky.store_stalled.wait(10)  # the only write thread is busy with job 1
    submit_stores(h, [(2, seen + new, [2, 3, 4, 5])])  # queued behind it
    assert tier.pool.cancel_queued() == 4
    flaky.store_gate.set()
    done = results(h, 2)
    assert done[1].success and not done[2].success
    assert len(callers) == 1 and callers[0] != threading.current_thread().name  # job 1's
    c = tier.counters
    assert c.objects_stored == 2 and c.transfers_cancelled == 4
    assert c.stores_not_admitted_rare == 0 and c.store_failures == 0
    assert all(k not in tier.presence for k in seen + new)


def test_a_failed_write_among_admitted_blocks_counts_only_itself(
        harness_factory, tmp_path, flaky) -> None:
    """Partial admission and a partial failure in one job: the job is reported
    failed; the failure counts the one block whose write failed, admission the
    blocks it skipped; both leave the presence index, the written one stays."""
    h = harness_factory([flaky_tier(tmp_path, admission="reuse")], num_chunks=16,
                        chunk_bytes=ROW)
    tier = h.tiers[0]
    seen, new = make_keys(2, seed=15), make_keys(3, seed=16)
    policy_of(tier).seen(seen)
    flaky.dead.add(seen[1])  # its write fails (a dead node's key)
    submit_stores(h, [(1, seen + new, [0, 1, 2, 3, 4])])
    result = results(h, 1)[1]
    assert not result.success
    c = tier.counters
    assert c.objects_stored == 1 and c.store_failures == 1 and c.stores_not_admitted_rare == 3
    assert tier.presence.stored(seen[0])
    assert all(k not in tier.presence for k in [seen[1], *new])
    assert set(tier.presence) == {seen[0]}


def test_a_job_reported_failed_whole_still_counts_what_it_skipped(
        harness_factory, tmp_path, monkeypatch) -> None:
    """The fault injected: applying the finished job raises, so it is reported failed
    as a whole. Its skipped blocks are counted as not admitted, not as failures."""
    h = harness_factory([{"type": "fs", "root_dir": str(tmp_path), "admission": "reuse"}],
                        num_chunks=16, chunk_bytes=ROW)
    tier = h.tiers[0]
    seen, new = make_keys(1, seed=17), make_keys(3, seed=18)
    policy_of(tier).seen(seen)

    def broken(*a: Any) -> None:
        raise RuntimeError("apply failed")

    monkeypatch.setattr(tier._ledger, "_apply_store", broken)
    submit_stores(h, [(1, seen + new, [0, 1, 2, 3])])
    assert not results(h, 1)[1].success
    c = tier.counters
    assert c.store_failures == 1 and c.stores_not_admitted_rare == 3
    assert all(k not in tier.presence for k in seen + new)


def test_a_skipped_block_evicted_while_its_job_runs_gets_no_event(
        harness_factory, tmp_path, flaky) -> None:
    """kv events on: an eviction heard for a block of a job in flight that the
    policy skips (another process's object) sends no removal, and the job's stored
    event names only the written block."""
    h = harness_factory([flaky_tier(tmp_path, n_write_threads=1, admission="reuse",
                                    enable_kv_events=True)], num_chunks=16, chunk_bytes=ROW)
    tier = h.tiers[0]
    seen, new = make_keys(1, seed=19), make_keys(1, seed=20)
    policy_of(tier).seen(seen)
    flaky.store_gate.clear()
    submit_stores(h, [(1, seen + new, [0, 1])])
    assert flaky.store_stalled.wait(10)
    tier.backend.evictions.note(1, [new[0]])
    h.step()  # the poll that hands it to the presence index
    flaky.store_gate.set()
    assert results(h, 1)[1].success
    events = list(tier.take_events())
    assert [(e.removed, list(e.keys)) for e in events] == [(False, seen)]
    assert not tier._ledger._evicted_in_flight


def test_a_half_open_probe_that_wrote_nothing_lets_the_next_job_probe(
        harness_factory, tmp_path) -> None:
    """The circuit's one probe job after its cooldown is a job the policy admitted
    none of: it proves nothing, so the next job probes, and its write closes it."""
    from kvstore_tiers.health import BreakerState

    h = harness_factory([{"type": "fs", "root_dir": str(tmp_path), "admission": "reuse"}],
                        num_chunks=16, chunk_bytes=ROW)
    tier = h.tiers[0]
    breaker = tier.breaker
    breaker.state, breaker._opened_at = BreakerState.OPEN, -1e9  # opened, cooled down
    seen, new = make_keys(2, seed=21), make_keys(2, seed=22)
    policy_of(tier).seen(seen)
    submit_stores(h, [(1, new, [0, 1])])  # the probe: nothing admitted
    assert results(h, 1)[1].success and breaker.state is BreakerState.HALF_OPEN
    submit_stores(h, [(2, seen, [2, 3])])
    assert results(h, 1)[2].success
    assert breaker.state is BreakerState.CLOSED and tier.counters.objects_stored == 2
