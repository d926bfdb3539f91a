"""fs capacity control: the cap holds, LRU order, shared by several processes."""

from __future__ import annotations

import fcntl
import multiprocessing as mp
import os
from pathlib import Path

import pytest

from kvstore_tiers.admin.harness import make_keys

from ...conftest import rows_like

ROW = 65536  # each object is 4096 + 65536 bytes on disk
CHUNK = 256 << 10


def _disk_bytes(root: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in root.rglob("*.kvf"))


def _overhead(root: Path) -> int:
    """A generous bound on a namespace directory's own bytes (its 4,096 shard
    directories and small files count in max_bytes: 16 MiB on ext4, 0 on tmpfs)."""
    probe = root / ".dir_probe"
    probe.mkdir()
    dir_bytes = probe.stat().st_blocks * 512
    probe.rmdir()
    return 4100 * dir_bytes + 16 * 4096




def test_cap_holds_and_least_recently_used_go_first(harness_factory, tmp_path) -> None:
    objects_cap = 40 * (ROW + 4096)
    cap = _overhead(tmp_path) + objects_cap
    h = harness_factory([{"type": "fs", "root_dir": str(tmp_path), "max_bytes": cap}],
                        num_chunks=16, chunk_bytes=ROW)
    tier = h.tiers[0]
    capacity = tier.backend.capacity
    first = make_keys(10, seed=1)
    h.store_all(first, rows_like(10, ROW))
    all_keys = list(first)
    for batch in range(2, 10):
        keys = make_keys(10, seed=batch)
        h.store_all(keys, rows_like(10, ROW, seed=batch))
        all_keys += keys
        capacity.evict_now(wait=True)  # what the evictor thread does when woken
    assert _disk_bytes(tmp_path) <= objects_cap + 16 * 4096
    assert capacity.evicted_objects >= 90 - 41
    assert tier.backend.evictions.for_capacity == tier.backend.evictions.objects > 0
    ns = tier.namespace
    present = [(tmp_path / ns.object_name(k)).exists() for k in all_keys]
    assert not any(present[:10]) and all(present[-10:])  # oldest gone, newest kept
    assert tier.get_stats() is not None and tier.counters.objects_evicted > 0


def test_evicted_objects_leave_the_presence_index(harness_factory, tmp_path) -> None:
    from vllm.v1.kv_offload.base import LookupResult

    objects_cap = 20 * (ROW + 4096)
    h = harness_factory([{"type": "fs", "root_dir": str(tmp_path), "enable_kv_events": True,
                          "max_bytes": _overhead(tmp_path) + objects_cap}],
                        num_chunks=16, chunk_bytes=ROW)
    tier = h.tiers[0]
    all_keys: list[bytes] = []
    for batch in range(5):
        keys = make_keys(10, seed=100 + batch)
        h.store_all(keys, rows_like(10, ROW, seed=batch))
        all_keys += keys
    ns = tier.namespace
    # The writers evicted while storing (their reservations wake the evictor); this
    # round brings the tier under its low watermark.
    tier.backend.capacity.evict_now(wait=True)
    evicted = [k for k in all_keys if not (tmp_path / ns.object_name(k)).exists()]
    kept = [k for k in all_keys if k not in evicted]
    assert len(evicted) >= 25 and kept
    assert tier.backend.evictions.objects == len(evicted)
    ctx = h.new_request()
    with h.locked():
        list(tier.get_finished_jobs())  # the poll that hands the evicted keys over
        assert not tier.backend.evictions.keys
        # kv events, in order: a consumer's view ends as what is on disk (a block
        # evicted while its store was in flight is in neither event).
        view: dict[bytes, bool] = {}
        for e in tier.take_events():
            assert e.medium.value == "STORAGE"
            view.update(dict.fromkeys(e.keys, not e.removed))
        assert sorted(k for k, stored in view.items() if stored) == sorted(kept)
        assert any(not stored for stored in view.values())  # removals went out
        assert not any(k in tier.presence for k in evicted)
        assert all(tier.lookup(k, ctx) is LookupResult.HIT for k in kept)
        # Gone: the existence check runs (RETRY), not a HIT whose load would fail.
        assert all(tier.lookup(k, ctx) is not LookupResult.HIT for k in evicted)
    h.finish_request(ctx)


def _writer(root: str, seed: int, cap: int, n_batches: int) -> None:
    from kvstore_tiers.admin.harness import build_harness

    h = build_harness([{"type": "fs", "root_dir": root, "max_bytes": cap}],
                      num_chunks=16, chunk_bytes=ROW)
    try:
        for b in range(n_batches):
            h.store_all(make_keys(8, seed=seed * 1000 + b), rows_like(8, ROW, seed=b))
    finally:
        h.shutdown()


def test_two_processes_sharing_a_root_stay_under_the_cap(tmp_path) -> None:
    objects_cap = 48 * (ROW + 4096)
    cap = _overhead(tmp_path) + objects_cap
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), s, cap, 12)) for s in (1, 2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
        assert p.exitcode == 0
    # Each file's room is reserved before it is written: the cap holds.
    from kvstore_tiers.backends.fs.capacity import CapacityController, scan
    from kvstore_tiers.backends.fs.config import FsConfig

    assert _disk_bytes(tmp_path) <= objects_cap + 16 * 4096
    (ns_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]

    cfg = FsConfig(root_dir=str(tmp_path), max_bytes=cap)
    CapacityController(ns_dir, cfg, lambda paths: None).evict_now(wait=True)
    total, _ = scan(ns_dir)
    assert total <= cap
    assert not list(tmp_path.rglob("*.tmp"))


def _ledger_busy(ns_dir: Path) -> bool:
    """Whether someone holds the ledger lock now (as another writer would find it)."""
    fd = os.open(ns_dir / ".usage", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops the lock if we got it
    return False


@pytest.mark.parametrize("room,granted", [(3 * CHUNK // 2, False), (2 * CHUNK, True)],
                         ids=["no-room-after-it", "room-for-both"])
def test_a_write_finishing_between_free_space_reading_and_reservation_is_counted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, room: int, granted: bool) -> None:
    """Writer B has reserved a chunk; writer A reads the free space, and B's write
    finishes right after that reading. B gives its reservation back as soon as
    the ledger lets it, so A must not decide on a reading that misses both B's
    bytes on disk and B's reservation: the floor holds, and A still gets room
    where there is room for both."""
    from kvstore_tiers.backends.fs.capacity import CapacityController
    from kvstore_tiers.backends.fs.config import FsConfig
    from kvstore_tiers.backends.fs.writers import WriterLock

    floor = 8 << 20
    ns_dir = tmp_path / "ns"
    ns_dir.mkdir()
    writer = WriterLock(ns_dir)
    cap = CapacityController(ns_dir, FsConfig(root_dir=str(tmp_path), min_free_bytes=floor),
                             lambda paths: None, writer)
    cap.reserve_wait_s = 0.0  # one try, then the store fails (no waiting in a test)
    free = floor + room  # the simulated filesystem: statvfs cannot be steered on demand
    finish_b_after_reading = False
    b_released = False

    def release_b() -> None:
        nonlocal b_released
        cap.release(CHUNK, CHUNK)
        b_released = True

    def reading() -> int:
        nonlocal free, finish_b_after_reading
        seen = free
        if finish_b_after_reading:
            finish_b_after_reading = False
            free -= CHUNK  # B's file is on disk now...
            if not _ledger_busy(ns_dir):
                release_b()  # ...and B gives its reservation back at once
        return seen

    monkeypatch.setattr(cap, "_free_bytes", reading)
    try:
        assert cap.reserve([CHUNK]) == 1  # B
        finish_b_after_reading = True
        got = cap.reserve([CHUNK])  # A
        if not b_released:
            release_b()  # B waited for the ledger lock A held
        if got:
            free -= CHUNK  # A's write
            cap.release(CHUNK, CHUNK)
        assert got == int(granted)
        assert free >= floor
    finally:
        cap.stop()
        writer.close()
