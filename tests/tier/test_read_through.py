"""Read-through: a block promoted from a later tier also lands in the caching tier.

Through vLLM's real manager with two secondary tiers, a node-local fs tier in
front of a real remote (redis-server, moto S3): engine A stores to both; a
fresh engine B with an empty fs root is served from the remote, and with
``read_through`` the blocks it loaded end up in its own fs root, so that once
its CPU tier forgot them they come from fs, not from the remote again.
"""

from __future__ import annotations

import time
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from vllm.v1.kv_offload.base import LookupResult

from kvstore_tiers.admin.harness import make_keys
from kvstore_tiers.errors import ConfigError
from kvstore_tiers.frame import checksum
from kvstore_tiers.readthrough import Intake, Mark, intake_of, mark

from ..conftest import rows_like
from ..faults.common import corrupt

ROW = 64 << 10
N = 8
HIT, MISS = LookupResult.HIT, LookupResult.MISS


@pytest.fixture(params=["redis", "s3"])
def remote(request: pytest.FixtureRequest) -> dict[str, Any]:
    if request.param == "redis":
        return {"type": "redis", "url": request.getfixturevalue("redis_server").url}
    return request.getfixturevalue("tier_config")()


def fs(root: Path, **keys: Any) -> dict[str, Any]:
    return {"type": "fs", "root_dir": str(root), **keys}


def step_until(h: Any, done: Any, timeout_s: float = 30.0) -> None:
    """Step the manager until ``done()`` (fills are no vLLM job: settle() cannot wait on them)."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "read-through fill did not finish"
        h.step()
        time.sleep(0.005)


def promote(h: Any, keys: list[bytes]) -> np.ndarray:
    """A new request finds ``keys`` in a secondary tier and loads them; its rows."""
    ctx = h.new_request()
    results, _ = h.lookup_until_resolved(keys, ctx)  # a loaded machine
    assert results == [HIT] * len(keys)
    rows = h.load(keys, ctx)
    h.settle()
    h.finish_request(ctx)
    return rows


def offer(h: Any, tier: Any, keys: list[bytes], rows: np.ndarray,
          marks: list[Mark] | None = None) -> None:
    """Offer ``rows`` to ``tier``'s intake as a load of a later tier does: they
    are put in the first primary rows and noted with their marks."""
    cids = list(range(len(keys)))
    h.view[cids] = rows
    marks = marks or [mark(memoryview(r)) for r in rows]
    part = intake(tier).take(list(keys), cids, marks)
    if part is not None:
        intake(tier).offer([part])


def intake(tier: Any) -> Intake:
    """The intake of ``tier``'s read-through layer."""
    found = intake_of(tier)
    assert found is not None, "the tier has no read-through layer"
    return found


def objects(root: Path) -> int:
    return len(list(root.rglob("*.kvf")))


def stored_by_a(harness_factory: Any, tmp_path: Path, remote: dict[str, Any]
                ) -> tuple[list[bytes], np.ndarray]:
    keys, rows = make_keys(N, seed=7), rows_like(N, ROW, seed=7)
    a = harness_factory([fs(tmp_path / "a"), remote], num_chunks=64, chunk_bytes=ROW)
    a.store_all(keys, rows)
    return keys, rows


def test_blocks_loaded_from_the_remote_are_cached_in_the_local_tier(
    harness_factory: Any, tmp_path: Path, remote: dict[str, Any]
) -> None:
    keys, rows = stored_by_a(harness_factory, tmp_path, remote)
    b = harness_factory([fs(tmp_path / "b", read_through=True), remote], num_chunks=64,
                        chunk_bytes=ROW)
    local, far = b.tiers
    assert np.array_equal(promote(b, keys), rows)
    assert far.counters.objects_loaded == N and local.counters.objects_loaded == 0
    step_until(b, lambda: local.counters.read_through_stored == N)
    assert objects(tmp_path / "b") == N
    assert local.counters.objects_stored == N and local.counters.read_through_dropped == 0

    b.forget_primary()  # the CPU tier forgot them: the local tier serves them now
    assert np.array_equal(promote(b, keys), rows)
    assert local.counters.objects_loaded == N and far.counters.objects_loaded == N


def test_without_read_through_the_local_tier_stays_empty(
    harness_factory: Any, tmp_path: Path, remote: dict[str, Any]
) -> None:
    keys, rows = stored_by_a(harness_factory, tmp_path, remote)
    b = harness_factory([fs(tmp_path / "b"), remote], num_chunks=64, chunk_bytes=ROW)
    local, far = b.tiers
    assert np.array_equal(promote(b, keys), rows)
    b.forget_primary()
    assert np.array_equal(promote(b, keys), rows)
    assert far.counters.objects_loaded == 2 * N and objects(tmp_path / "b") == 0
    assert local.counters.read_through_stored == 0


def test_a_block_is_written_once_and_a_corrupt_one_never(
    harness_factory: Any, tmp_path: Path, redis_server: Any
) -> None:
    remote = {"type": "redis", "url": redis_server.url}
    keys, rows = stored_by_a(harness_factory, tmp_path, remote)
    b = harness_factory([fs(tmp_path / "b", read_through=True), remote], num_chunks=64,
                        chunk_bytes=ROW)
    local, far = b.tiers
    corrupt(far, keys[3])  # the remote's copy of block 3 fails its checksum
    ctx = b.new_request()
    results, _ = b.lookup_until_resolved(keys[:3], ctx)
    assert results == [HIT] * 3
    b.load(keys[:3], ctx)
    b.settle()
    results, _ = b.lookup_until_resolved(keys[3:4], ctx)
    if results == [HIT]:  # found, then its load fails the frame check: a miss, never bytes
        b.load(keys[3:4], ctx)
        b.settle()
    b.finish_request(ctx)
    step_until(b, lambda: local.counters.read_through_stored == 3)
    assert far.counters.corrupt_objects == 1 and objects(tmp_path / "b") == 3

    # The same blocks offered again (as by a second load from the remote) are not rewritten.
    offer(b, local, keys[:3], rows[:3])
    b.step()
    step_until(b, lambda: not intake(local).offers)
    assert local.counters.objects_stored == 3 and local.counters.read_through_stored == 3


def test_blocks_waiting_are_bounded(harness_factory: Any, tmp_path: Path) -> None:
    row = 512 << 10  # read_through_max_bytes is at least 1 MiB: two rows
    b = harness_factory([fs(tmp_path / "b", read_through=True, read_through_max_bytes=1 << 20),
                         fs(tmp_path / "far")], num_chunks=16, chunk_bytes=row)
    local = b.tiers[0]
    keys, rows = make_keys(3, seed=9), rows_like(3, row, seed=9)
    offer(b, local, keys, rows)  # three rows do not fit
    offer(b, local, keys[:2], rows[:2])
    step_until(b, lambda: local.counters.read_through_stored == 2)
    assert local.counters.read_through_dropped == 3 and objects(tmp_path / "b") == 2


def test_one_tier_of_a_manager_may_read_through(harness_factory: Any, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="read_through"):
        harness_factory([fs(tmp_path / "1", read_through=True),
                         fs(tmp_path / "2", read_through=True), fs(tmp_path / "3")],
                        num_chunks=16, chunk_bytes=4096)


@pytest.mark.parametrize("off", [False, "false", 0, "off"])
def test_a_tier_that_sets_read_through_off_is_not_a_second_caching_tier(
    harness_factory: Any, tmp_path: Path, off: Any
) -> None:
    """``read_through`` is read as the tier's own config reads it: a value that
    means off (``"false"`` included) leaves one caching tier."""
    b = harness_factory([fs(tmp_path / "1", read_through=True),
                         fs(tmp_path / "2", read_through=off)], num_chunks=16, chunk_bytes=4096)
    assert [intake_of(t) is not None for t in b.tiers] == [True, False]


def test_a_read_through_that_is_no_boolean_fails_naming_the_key(harness_factory: Any,
                                                                tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'read_through'"):
        harness_factory([fs(tmp_path / "1", read_through=True),
                         fs(tmp_path / "2", read_through="maybe")], num_chunks=16,
                        chunk_bytes=4096)


def test_blocks_offered_again_with_new_ones_write_only_the_new(
    harness_factory: Any, tmp_path: Path
) -> None:
    """A fill whose keys the tier partly holds is a fill of the others only, and
    answers for every block offered (nothing stays pending)."""
    b = harness_factory([fs(tmp_path / "b", read_through=True), fs(tmp_path / "far")],
                        num_chunks=16, chunk_bytes=ROW)
    local = b.tiers[0]
    keys, rows = make_keys(4, seed=19), rows_like(4, ROW, seed=19)
    offer(b, local, keys[:2], rows[:2])
    b.settle()
    offer(b, local, keys, rows)
    b.settle()
    assert local.counters.read_through_stored == 4 and local.counters.read_through_dropped == 0
    assert local.counters.objects_stored == 4 and objects(tmp_path / "b") == 4
    assert intake(local).pending_bytes == 0 and not b.manager.has_pending_work()


def test_the_tier_has_pending_work_until_its_fills_are_written(
    harness_factory: Any, tmp_path: Path
) -> None:
    """A fill is no vLLM job: the tier itself keeps an idle engine stepping until
    the copies are written (else they would wait for the next request)."""
    b = harness_factory([fs(tmp_path / "b", read_through=True), fs(tmp_path / "far")],
                        num_chunks=16, chunk_bytes=ROW)
    local = b.tiers[0]
    keys, rows = make_keys(4, seed=11), rows_like(4, ROW, seed=11)
    assert not b.manager.has_pending_work()
    offer(b, local, keys, rows)
    assert b.manager.has_pending_work()
    b.settle()  # steps while the manager has pending work
    assert local.counters.read_through_stored == 4 and objects(tmp_path / "b") == 4
    assert not b.manager.has_pending_work()


def test_a_row_reused_before_the_fill_reads_it_is_not_cached(
    harness_factory: Any, tmp_path: Path
) -> None:
    """vLLM may reuse a primary row once it has the load: the fill writes a block
    only if its snapshot of the row still has the CRC the load verified."""
    b = harness_factory([fs(tmp_path / "b", read_through=True), fs(tmp_path / "far")],
                        num_chunks=16, chunk_bytes=ROW)
    local = b.tiers[0]
    keys, rows = make_keys(4, seed=13), rows_like(4, ROW, seed=13)
    offer(b, local, keys, rows)
    b.view[2] = rows_like(1, ROW, seed=14)[0]  # row 2 now holds another block
    b.settle()
    assert local.counters.read_through_stored == 3 and local.counters.read_through_dropped == 1
    assert objects(tmp_path / "b") == 3

    b.forget_primary()
    ctx = b.new_request()
    results, _ = b.lookup_until_resolved(keys, ctx)
    assert results == [HIT, HIT, MISS, HIT]
    assert np.array_equal(b.load([keys[i] for i in (0, 1, 3)], ctx), rows[[0, 1, 3]])
    b.settle()
    b.finish_request(ctx)


def test_a_reused_row_with_the_same_crc_is_not_cached(harness_factory: Any, tmp_path: Path) -> None:
    """The CRC-32C alone does not decide: a row whose bytes differ from those
    sampled at the load is not cached even where its CRC matches (as a
    collision would)."""
    b = harness_factory([fs(tmp_path / "b", read_through=True), fs(tmp_path / "far")],
                        num_chunks=16, chunk_bytes=ROW)
    local = b.tiers[0]
    keys, rows = make_keys(2, seed=15), rows_like(2, ROW, seed=15)
    other = rows_like(1, ROW, seed=16)[0]
    marks = [mark(memoryview(rows[0])), (checksum(memoryview(other)), mark(memoryview(rows[1]))[1])]
    offer(b, local, keys, np.stack([rows[0], other]), marks)  # row 1 holds another block
    b.settle()
    assert local.counters.read_through_stored == 1 and local.counters.read_through_dropped == 1


def test_a_drain_drops_what_was_loaded_before_it(harness_factory: Any, tmp_path: Path) -> None:
    """reset_cache drains the tiers and vLLM frees the primary rows: blocks
    loaded before it are not cached (no fill reads those rows)."""
    b = harness_factory([fs(tmp_path / "b", read_through=True), fs(tmp_path / "far")],
                        num_chunks=16, chunk_bytes=ROW)
    local = b.tiers[0]
    keys, rows = make_keys(4, seed=17), rows_like(4, ROW, seed=17)
    offer(b, local, keys, rows)
    b.forget_primary()
    b.settle()
    assert local.counters.read_through_stored == 0 and local.counters.read_through_dropped == 4
    assert objects(tmp_path / "b") == 0 and not b.manager.has_pending_work()
    offer(b, local, keys, rows)  # loads after the drain are cached again
    b.settle()
    assert local.counters.read_through_stored == 4


def test_snapshot_buffers_are_reused(harness_factory: Any, tmp_path: Path) -> None:
    """A fill takes the buffers a finished one gave back (their pages are faulted
    in already) and gives them back in turn."""
    b = harness_factory([fs(tmp_path / "b", read_through=True), fs(tmp_path / "far")],
                        num_chunks=16, chunk_bytes=ROW)
    local = b.tiers[0]
    kept = intake(local).buffers(3)
    for buf in kept:
        buf[:] = b"\xab" * len(buf)
    intake(local).give_back(kept)
    keys, rows = make_keys(3, seed=12), rows_like(3, ROW, seed=12)
    offer(b, local, keys, rows)
    b.settle()
    assert local.counters.read_through_stored == 3
    again = intake(local).buffers(3)
    assert {id(buf) for buf in again} == {id(buf) for buf in kept}
    assert any(bytes(buf) in {r.tobytes() for r in rows} for buf in again), "used by the fill"


def test_a_tier_builds_with_a_spec_that_takes_no_weak_reference(harness_factory: Any,
                                                                 tmp_path: Path) -> None:
    """vLLM's own tier tests pass a SimpleNamespace as the spec: a tier, caching
    or not, finds no other tier through it and builds."""
    h = harness_factory([fs(tmp_path / "a")], num_chunks=4, chunk_bytes=4096)
    stand_in = SimpleNamespace(**vars(h.spec))
    with pytest.raises(TypeError):
        weakref.ref(stand_in)
    view = h.manager.primary_tier.get_kv_memoryview()
    for keys in ({}, {"read_through": True}):
        tier = type(h.tiers[0])(stand_in, view, "fs", root_dir=str(tmp_path / "b"), **keys)
        try:
            tier.on_schedule_end(None)  # the first step wires nothing: the spec built no tiers
            assert tier.presence is not None
        finally:
            tier.shutdown()


def test_subscribe_says_so_when_the_caching_tier_is_not_in_vllms_list() -> None:
    """A vLLM that keeps its built tiers where compat does not look leaves read-through
    with nothing to subscribe to: one warning says the tier caches nothing."""
    import logging

    from kvstore_tiers import readthrough

    class Recorder(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    class Tier:
        def __init__(self) -> None:
            self.observed: list[Any] = []

        def observe_loads(self, intake: Any) -> None:
            self.observed.append(intake)

    log = logging.getLogger("kvstore_tiers.readthrough")
    rec = Recorder()
    log.addHandler(rec)
    try:
        caching, later, intake = Tier(), Tier(), object()
        readthrough.subscribe(intake, [later], caching)  # the list lacks the caching tier
        assert later.observed == [] and any("caches nothing" in m for m in rec.messages)
        rec.messages.clear()
        readthrough.subscribe(intake, [caching, later], caching)
        assert later.observed == [intake] and caching.observed == [] and rec.messages == []
    finally:
        log.removeHandler(rec)
