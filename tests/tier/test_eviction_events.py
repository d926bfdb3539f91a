"""kv events of blocks that left the tier: a consumer never ends up believing a gone
block is stored (the ledger's ``forget_evicted``)."""

from __future__ import annotations

from kvstore_tiers.admin.harness import make_keys

from ..conftest import rows_like
from .flaky import flaky_tier

ROW = 4096


def test_a_block_evicted_while_its_store_is_in_flight_is_never_reported_stored(
        harness_factory, tmp_path, flaky) -> None:
    h = harness_factory([flaky_tier(tmp_path, n_write_threads=1, enable_kv_events=True)],
                        num_chunks=64, chunk_bytes=ROW)
    tier = h.tiers[0]
    stored_before = make_keys(4, seed=1)
    h.store_all(stored_before, rows_like(4, ROW))
    assert sorted(k for e in tier.take_events() for k in e.keys) == sorted(stored_before)

    flaky.store_gate.clear()
    keys = make_keys(4, seed=2)
    ctx = h.store(keys, rows_like(4, ROW))
    assert flaky.store_stalled.wait(10)  # the job is in flight
    # The backend reports an eviction of a stored block and of the in-flight one
    # (what the fs evictor or a Redis keyevent hands over, injected at this moment).
    tier.backend.evictions.note(2, [stored_before[0], keys[0]])
    h.step()  # the poll that hands them to the presence index
    flaky.store_gate.set()
    h.settle()
    h.finish_request(ctx)

    events = list(tier.take_events())
    # Removed: only the block whose stored event went out. Stored: the job's other
    # blocks; the one evicted in flight is in neither, and not in the index.
    assert [k for e in events if e.removed for k in e.keys] == [stored_before[0]]
    assert sorted(k for e in events if not e.removed for k in e.keys) == sorted(keys[1:])
    assert keys[0] not in tier.presence and stored_before[0] not in tier.presence
    assert tier.counters.objects_stored == 8


def test_a_store_failed_as_a_whole_forgets_its_evicted_keys(harness_factory, tmp_path, flaky,
                                                            monkeypatch) -> None:
    """A key evicted while its job was in flight, when that job is then reported failed
    as a whole (applying it broke), must not be left out of a later job's stored event."""
    h = harness_factory([flaky_tier(tmp_path, n_write_threads=1, enable_kv_events=True)],
                        num_chunks=64, chunk_bytes=ROW)
    tier = h.tiers[0]
    ledger = tier._ledger
    flaky.store_gate.clear()
    keys = make_keys(2, seed=3)
    ctx = h.store(keys, rows_like(2, ROW))
    assert flaky.store_stalled.wait(10)
    tier.backend.evictions.note(1, [keys[0]])
    h.step()
    # The fault injected: applying the finished job raises, so it is reported failed.
    apply_store = ledger._apply_store
    monkeypatch.setattr(ledger, "_apply_store",
                        lambda job, s: (_ for _ in ()).throw(RuntimeError("injected")))
    flaky.store_gate.set()
    h.settle()
    h.finish_request(ctx)
    assert tier.counters.store_failures == 2
    monkeypatch.setattr(ledger, "_apply_store", apply_store)
    list(tier.take_events())

    h.forget_primary()
    h.store_all(keys, rows_like(2, ROW))  # stored again, both reported stored
    assert sorted(k for e in tier.take_events() if not e.removed for k in e.keys) == \
        sorted(keys)
