"""A drain that cancels queued transfers is not a backend failure (issue 25).

vLLM's ``reset_cache`` (prefix-cache reset, sleep, weight update) calls
``drain_jobs``, which may cancel queued jobs. They must be reported failed
to vLLM exactly once and their rows released, but they say nothing about
the backend: the circuit breaker must not open, or every reset would take
the tier offline for its cooldown.
"""

from __future__ import annotations

import threading

from vllm.v1.kv_offload.base import LookupResult

from kvstore_tiers.admin.harness import make_keys
from kvstore_tiers.health import BreakerState, CircuitBreaker

from ..conftest import rows_like
from .flaky import flaky_tier

ROW = 4096
HIT = LookupResult.HIT


def test_reset_cache_cancelling_queued_stores_keeps_the_breaker_closed(
    harness_factory, tmp_path, flaky
) -> None:
    h = harness_factory([flaky_tier(tmp_path, n_read_threads=1, n_write_threads=1,
                                    failure_threshold=2)], num_chunks=64, chunk_bytes=ROW)
    tier = h.tiers[0]
    reported: list[tuple[int, bool]] = []
    submitted: list[int] = []
    finished, submit = tier.get_finished_jobs, tier.submit_store

    def record_finished():  # instrumentation: what vLLM is told, unchanged
        out = list(finished())
        reported.extend((r.job_id, r.success) for r in out)
        return out

    def record_submit(job):
        submitted.append(job.job_id)
        submit(job)

    tier.get_finished_jobs, tier.submit_store = record_finished, record_submit
    flaky.store_gate.clear()
    keys = [make_keys(4, seed=100 + i) for i in range(7)]
    rows = rows_like(4, ROW)
    ctxs = [h.store(keys[0], rows)]
    assert flaky.store_stalled.wait(10)  # the one write thread is busy with job 1
    ctxs += [h.store(k, rows) for k in keys[1:]]  # six cascades queue behind it
    assert len(submitted) == 7
    threading.Timer(0.3, flaky.store_gate.set).start()
    h.forget_primary()  # reset_cache: drain_jobs cancels the six, waits for the first
    h.settle()
    for ctx in ctxs:
        h.finish_request(ctx)

    c = tier.counters
    assert tier.breaker.state is BreakerState.CLOSED and tier.breaker.times_opened == 0
    assert c.store_failures == 0 and c.transfers_cancelled == 24
    assert c.objects_stored == 4
    assert sorted(job_id for job_id, _ in reported) == sorted(submitted)  # each exactly once
    assert sum(ok for _, ok in reported) == 1
    m, p = h.manager, h.manager.primary_tier
    assert not m._jobs  # vLLM holds no job of ours
    assert p._get_num_free_chunks() + p._num_evictable_cache_chunks == p._num_chunks

    # The tier stays online: the next cascade is stored, and a cancelled key
    # can be stored again (its receipt was dropped).
    h.store_all(keys[1] + make_keys(2, seed=99), rows_like(6, ROW))
    assert c.objects_stored == 10
    h.forget_primary()
    ctx = h.new_request()
    assert h.lookup_until_resolved(keys[0] + keys[1], ctx)[0] == [HIT] * 8
    h.finish_request(ctx)


def test_a_cancelled_half_open_probe_lets_the_next_job_probe() -> None:
    now = [0.0]
    breaker = CircuitBreaker("t", threshold=1, cooldown_s=5.0, clock=lambda: now[0])
    breaker.record_keys(answered=0, failed=3)
    assert breaker.state is BreakerState.OPEN
    now[0] = 6.0
    assert breaker.allow()  # the probe
    assert not breaker.allow()
    breaker.record_keys(answered=0, failed=0)  # the probe was cancelled by a drain
    assert breaker.allow()  # not wedged half-open: the next job probes
    breaker.record_keys(answered=1, failed=0)
    assert breaker.state is BreakerState.CLOSED
