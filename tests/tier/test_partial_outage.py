"""A partial outage costs only its keys (issue 25).

One dead Redis Cluster master (of three) fails the keys it owns while the
others are served. The breaker must not count a job in which some keys were
answered as a failed job: the live keys keep being stored and loaded, and
only the dead keys miss. A backend that fails a fixed third of the keys
plays the dead node here (tests/redis has the real cluster).
"""

from __future__ import annotations

import pytest
from vllm.v1.kv_offload.base import LookupResult

from kvstore_tiers.admin.harness import make_keys
from kvstore_tiers.compat import detector_accepts_failure_threshold
from kvstore_tiers.health import BreakerState

from ..conftest import rows_like
from .flaky import flaky_tier

ROW = 4096
HIT, MISS = LookupResult.HIT, LookupResult.MISS


def test_a_dead_third_of_the_keys_leaves_the_rest_served(harness_factory, tmp_path,
                                                          flaky) -> None:
    h = harness_factory([flaky_tier(tmp_path, failure_threshold=2)], num_chunks=64,
                        chunk_bytes=ROW)
    tier = h.tiers[0]
    keys = make_keys(24, seed=7)
    rows = rows_like(24, ROW, seed=7)
    dead = set(keys[::3])
    flaky.dead.update(dead)

    for i in range(0, 24, 4):  # six store jobs, each with one or two dead keys
        h.store_all(keys[i:i + 4], rows[i:i + 4])
    c = tier.counters
    assert tier.breaker.state is BreakerState.CLOSED
    assert c.objects_stored == 16 and c.store_failures == 8

    # Loads: the dead keys' objects exist now, their reads fail.
    flaky.dead.clear()
    h.forget_primary()
    for i in range(0, 24, 4):
        h.store_all(keys[i:i + 4], rows[i:i + 4])
    assert c.objects_stored == 24
    flaky.dead.update(dead)
    for _round in range(3):  # three requests, each promoting every key
        h.forget_primary()
        ctx = h.new_request()
        results, _ = h.lookup_until_resolved(keys, ctx)
        live = [k for k, r in zip(keys, results, strict=True) if r == HIT]
        assert set(live) == set(keys) - dead, "a live key missed"
        loaded = h.load(live, ctx)
        want = {k: r for k, r in zip(keys, rows, strict=True)}
        assert all(row.tobytes() == want[k].tobytes() for k, row in zip(live, loaded,
                                                                        strict=True))
        h.finish_request(ctx)
        assert tier.breaker.state is BreakerState.CLOSED

    # The rule still protects against a dead backend: jobs in which no key
    # is answered open the circuit after ``failure_threshold`` of them.
    flaky.dead.update(keys)
    h.forget_primary()
    for i in range(2):
        ctx = h.new_request()
        h.lookup_until_resolved(keys[i * 4:i * 4 + 4], ctx)
        h.finish_request(ctx)
    assert tier.breaker.state is BreakerState.OPEN


@pytest.mark.skipif(not detector_accepts_failure_threshold(),
                    reason="vLLM 0.32's backpressure detector hears no failed stores")
def test_a_dead_third_of_the_keys_does_not_make_vllm_shed_the_live_stores(
        harness_factory, tmp_path, flaky) -> None:
    """vLLM 0.33 feeds every failed store job to the detector, and one dead key makes a
    job failed; a remote tier's default detector counts only the jobs the breaker
    counts (kvstore_tiers/backpressure.py), so the live keys keep being offered."""
    h = harness_factory([flaky_tier(tmp_path, failure_threshold=2, type="FlakyRemoteTier")],
                        num_chunks=64, chunk_bytes=ROW)
    tier = h.tiers[0]
    keys = make_keys(24, seed=8)
    rows = rows_like(24, ROW, seed=8)
    flaky.dead.update(keys[::3])
    for i in range(0, 24, 4):  # six store jobs, each with one or two dead keys
        h.store_all(keys[i:i + 4], rows[i:i + 4])
    c, detector = tier.counters, tier.bp_detector
    assert c.objects_stored == 16 and c.store_failures == 8
    assert not detector.is_under_pressure()

    # Jobs in which no key is answered still put vLLM's detector under pressure.
    more = make_keys(8, seed=9)
    flaky.dead.update(more)
    for i in range(0, 8, 4):
        h.store_all(more[i:i + 4], rows_like(4, ROW, seed=9 + i))
    assert detector.is_under_pressure()
