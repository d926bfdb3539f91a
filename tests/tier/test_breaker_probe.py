"""The circuit's half-open probe is a job that reaches the backend, or it is given back.

After its cooldown the breaker lets one job through (``allow``) and waits
for that job's outcome to close or reopen. A job the tier then answers
without the backend -- a store whose blocks the tier holds already, a store
dropped for backpressure -- has no outcome for the breaker: unless the probe
is given back, the circuit stays half-open with its probe out, every lookup
misses and every store is dropped, for good. Found by the partition test
(tests/fleet/test_partition.py): a host whose recomputed blocks were the
ones it had failed to load got its first store after the cooldown refused
this way, and never used the healed tier again.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.base import LookupResult

from kvstore_tiers.admin.harness import make_keys, rows_for
from kvstore_tiers.health import BreakerState

from .flaky import flaky_tier
from .jobs import results, submit_stores

ROW = 4096
HIT, MISS = LookupResult.HIT, LookupResult.MISS


def _open_and_cool(tier: Any) -> None:
    breaker = tier.breaker
    breaker.state, breaker._opened_at = BreakerState.OPEN, -1e9  # opened, cooled down


def _stored_then_cooled(harness_factory: Any, tmp_path: Any, seed: int) -> tuple[Any, Any, Any]:
    """A harness whose tier holds 4 blocks (not in the primary) and whose circuit has
    opened and cooled down: the next job is the half-open probe."""
    h = harness_factory([flaky_tier(tmp_path)], num_chunks=16, chunk_bytes=ROW)
    keys = make_keys(4, seed=seed)
    rows = rows_for(keys, ROW)
    h.store_all(keys, rows)
    h.forget_primary()
    _open_and_cool(h.tiers[0])
    return h, keys, rows


def _probe_load_closes_the_circuit(h: Any, keys: Any, rows: Any) -> None:
    """The next job is a load of ``keys``: the healthy backend serves ``rows`` byte for
    byte, and that probe closes the circuit."""
    ctx = h.new_request()
    found, _ = h.lookup_until_resolved(keys, ctx)
    assert found == [HIT] * 4
    assert h.load(keys, ctx).tobytes() == rows.tobytes()
    h.finish_request(ctx)
    assert h.tiers[0].breaker.state is BreakerState.CLOSED


def test_a_probe_store_of_blocks_held_already_lets_a_load_probe(
        harness_factory, tmp_path) -> None:
    h, keys, rows = _stored_then_cooled(harness_factory, tmp_path, seed=31)
    # the first job after the cooldown: a store of blocks the tier holds (nothing to write)
    submit_stores(h, [(900, keys, [0, 1, 2, 3])])
    assert results(h, 1)[900].success
    # the next job is the probe: a load, which the healthy backend serves
    _probe_load_closes_the_circuit(h, keys, rows)


def test_a_probe_store_dropped_for_backpressure_lets_the_next_job_probe(
        harness_factory, tmp_path, flaky) -> None:
    h = harness_factory([flaky_tier(tmp_path, max_store_bytes_in_flight=2 * ROW)],
                        num_chunks=16, chunk_bytes=ROW)
    tier = h.tiers[0]
    stuck, big, later = make_keys(1, seed=32), make_keys(2, seed=33), make_keys(1, seed=34)
    h.view[:4] = rows_for(stuck + big + later, ROW)
    flaky.store_gate.clear()
    submit_stores(h, [(901, stuck, [0])])  # in flight, held at the gate
    assert flaky.store_stalled.wait(10)
    _open_and_cool(tier)
    submit_stores(h, [(902, big, [1, 2])])  # past the bound: dropped for backpressure
    assert results(h, 1)[902].success
    assert tier.counters.stores_dropped_backpressure == 2
    submit_stores(h, [(903, later, [3])])  # the probe: queued, not dropped by the breaker
    assert tier.counters.stores_dropped == 0
    flaky.store_gate.set()
    done = results(h, 2)
    assert done[901].success and done[903].success
    assert tier.breaker.state is BreakerState.CLOSED
    assert tier.counters.objects_stored == 2


def test_a_probe_whose_outcome_is_unknown_is_given_back(
        harness_factory, tmp_path, monkeypatch) -> None:
    """A probe job that fails as a whole (condensing its outcomes broke, so what the
    backend answered is unknown) proved nothing about the backend: the next job probes."""
    from kvstore_tiers.job import Job

    h, keys, rows = _stored_then_cooled(harness_factory, tmp_path, seed=35)
    tier = h.tiers[0]
    real = Job.summarise

    def broken(self: Job) -> Any:
        raise RuntimeError("condensing the outcomes broke")

    monkeypatch.setattr(Job, "summarise", broken)
    ctx = h.new_request()
    found, _ = h.lookup_until_resolved(keys, ctx)  # its load is the probe: failed as a whole
    assert found == [MISS] * 4
    h.finish_request(ctx)
    monkeypatch.setattr(Job, "summarise", real)
    assert not tier.breaker.is_open  # given back: lookups go on
    _probe_load_closes_the_circuit(h, keys, rows)
