"""The I/O pool: load priority, per-chunk parallelism, bounded queue, cancellation."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from kvstore_tiers.pool import IOPool, PoolJob


class _Job(PoolJob):
    """Logs the label of every slot it runs; optionally waits on a gate or barrier."""

    def __init__(self, job_id: int, labels: list[str], log: list[str], *, batch: int = 1,
                 gate: threading.Event | None = None,
                 barrier: threading.Barrier | None = None) -> None:
        super().__init__(job_id, len(labels), batch)
        self.labels, self.log, self.gate, self.barrier = labels, log, gate, barrier
        self.cancelled: list[str] = []
        self.batches: list[tuple[int, int]] = []
        self.finished_calls = 0
        self.started = threading.Event()
        #: (thread, slots run or cancelled so far, runs) at each start() call.
        self.start_calls: list[tuple[threading.Thread, int, bool]] = []

    def start(self, runs: bool) -> None:
        self.start_calls.append((threading.current_thread(),
                                 len(self.batches) + len(self.cancelled), runs))

    def run(self, ctx: Any, start: int, stop: int) -> None:
        self.batches.append((start, stop))
        self.started.set()
        if self.gate is not None:
            self.gate.wait(10)
        if self.barrier is not None:
            self.barrier.wait(10)  # only passes if all parties run at once
        self.log.extend(self.labels[start:stop])

    def cancel(self, start: int, stop: int) -> None:
        self.cancelled.extend(self.labels[start:stop])

    def finish(self) -> None:
        self.finished_calls += 1


def _drain(pool: IOPool) -> list[int]:
    pool.wait_idle()
    done = []
    while pool.finished:
        done.append(pool.finished.popleft().job_id)
    return done


def test_loads_run_before_queued_stores() -> None:
    pool = IOPool(1, 0, 100, ctx_factory=lambda: None)
    log: list[str] = []
    gate = threading.Event()
    try:
        blocker = _Job(0, ["blocker"], log, gate=gate)
        assert pool.submit(blocker, False)
        assert blocker.started.wait(10)  # the only thread is now busy
        assert pool.submit(_Job(1, ["store"], log), is_load=False)
        assert pool.submit(_Job(2, ["load"], log), is_load=True)
        gate.set()
        pool.wait_idle()
        assert log == ["blocker", "load", "store"]
    finally:
        pool.shutdown()


def test_one_jobs_chunks_move_in_parallel() -> None:
    """A single request's chunks are spread over threads (vLLM's fs pool uses one)."""
    pool = IOPool(4, 0, 100, ctx_factory=lambda: None)
    log: list[str] = []
    job = _Job(7, [f"c{i}" for i in range(4)], log, barrier=threading.Barrier(4))
    try:
        assert pool.submit(job, is_load=True)
        assert _drain(pool) == [7]  # exactly one completion for the job
        assert sorted(log) == ["c0", "c1", "c2", "c3"]
        assert not job.barrier.broken  # type: ignore[union-attr]
        assert job.finished_calls == 1
    finally:
        pool.shutdown()


def test_a_burst_of_jobs_reaches_every_thread() -> None:
    """Jobs queued back to back (as vLLM's scheduler queues one per request in
    a step) all run at once: coalescing their wake-ups into one loses none."""
    pool = IOPool(6, 0, 100, ctx_factory=lambda: None)
    log: list[str] = []
    barrier = threading.Barrier(6)
    jobs = [_Job(i, [f"j{i}"], log, barrier=barrier) for i in range(6)]
    try:
        for job in jobs:
            assert pool.submit(job, is_load=True)
        assert sorted(_drain(pool)) == list(range(6))
        assert not barrier.broken  # all six ran at the same time
        # Idle again: a later job still wakes a sleeper.
        assert pool.submit(_Job(9, ["late"], log), is_load=True)
        assert _drain(pool) == [9]
        assert sorted(log) == ["j0", "j1", "j2", "j3", "j4", "j5", "late"]
    finally:
        pool.shutdown()


def test_batches_cover_every_slot_once() -> None:
    pool = IOPool(3, 1, 100, ctx_factory=lambda: None)
    log: list[str] = []
    job = _Job(3, [str(i) for i in range(10)], log, batch=4)
    try:
        assert pool.submit(job, is_load=False)
        assert _drain(pool) == [3]
        assert sorted(job.batches) == [(0, 4), (4, 8), (8, 10)]
        assert sorted(log, key=int) == job.labels
        assert job.finished_calls == 1
    finally:
        pool.shutdown()


def test_bounded_queue_refuses_instead_of_blocking() -> None:
    pool = IOPool(1, 0, max_queued_chunks=3, ctx_factory=lambda: None)
    gate = threading.Event()
    log: list[str] = []
    try:
        blocker = _Job(0, ["b"], log, gate=gate)
        assert pool.submit(blocker, True)
        assert blocker.started.wait(10)
        assert pool.submit(_Job(9, ["probe"], log), True)
        # The blocker holds the only thread; "probe" (1 chunk) is queued, so
        # 2 more chunks fit and a third does not.
        assert pool.submit(_Job(1, ["x0", "x1"], log), True)
        assert not pool.submit(_Job(2, ["y"], log), True)
        gate.set()
        assert sorted(_drain(pool)) == [0, 1, 9]
    finally:
        pool.shutdown()


def test_cancelled_chunks_still_complete_their_job() -> None:
    pool = IOPool(1, 0, 100, ctx_factory=lambda: None)
    gate = threading.Event()
    log: list[str] = []
    try:
        blocker = _Job(0, ["b"], log, gate=gate)
        assert pool.submit(blocker, True)
        assert blocker.started.wait(10)
        queued = _Job(1, ["q0", "q1", "q2"], log)
        assert pool.submit(queued, is_load=False)
        assert pool.cancel_queued() == 3
        assert queued.cancelled == ["q0", "q1", "q2"]
        # Never taken, so started by the cancelling thread, before its cancel,
        # told that none of it will run.
        assert queued.start_calls == [(threading.current_thread(), 0, False)]
        gate.set()
        assert sorted(_drain(pool)) == [0, 1]
        assert log == ["b"]  # cancelled chunks never ran
        assert queued.finished_calls == 1
    finally:
        pool.shutdown()


def test_a_job_cut_mid_way_reports_once() -> None:
    """Cancelling a job some of whose chunks already run: one completion, every slot once."""
    pool = IOPool(1, 0, 100, ctx_factory=lambda: None)
    gate = threading.Event()
    log: list[str] = []
    try:
        job = _Job(5, ["a", "b", "c", "d"], log, gate=gate)
        assert pool.submit(job, True)
        assert job.started.wait(10)  # slot 0 runs, slots 1-3 are queued
        assert pool.cancel_queued() == 3
        gate.set()
        assert _drain(pool) == [5]
        assert log == ["a"] and job.cancelled == ["b", "c", "d"]
        assert job.finished_calls == 1
    finally:
        pool.shutdown()


def test_a_job_is_started_once_on_an_io_thread_before_its_slots() -> None:
    """Per-slot state is made off the submitting (scheduler) thread, before any slot runs."""
    pool = IOPool(3, 2, 100, ctx_factory=lambda: None)
    log: list[str] = []
    jobs = [_Job(i, [f"{i}.{s}" for s in range(5)], log, batch=2) for i in range(6)]
    try:
        for i, job in enumerate(jobs):
            assert pool.submit(job, is_load=i % 2 == 0)
        assert sorted(_drain(pool)) == list(range(6))
        for job in jobs:
            assert len(job.start_calls) == 1
            thread, slots_before, runs = job.start_calls[0]
            assert slots_before == 0 and runs
            assert thread is not threading.current_thread()
            assert thread.name.startswith("kvstore_io")
    finally:
        pool.shutdown()


def test_shutdown_joins_every_thread() -> None:
    pool = IOPool(3, 2, 100, ctx_factory=lambda: None, name="kvstore_unit")
    pool.shutdown()
    assert not [t for t in threading.enumerate() if t.name.startswith("kvstore_unit")]
    assert not pool.submit(_Job(1, ["late"], []), True)  # refused, never hangs


def test_load_threads_leave_stores_to_store_threads() -> None:
    """A queued store waits for a store thread; a load thread stays free for loads."""
    pool = IOPool(1, 1, 100, ctx_factory=lambda: None)
    gate = threading.Event()
    log: list[str] = []
    try:
        blocker = _Job(0, ["store-blocker"], log, gate=gate)
        assert pool.submit(blocker, is_load=False)
        assert blocker.started.wait(10)  # the store thread is busy
        queued = _Job(1, ["store-queued"], log)
        assert pool.submit(queued, is_load=False)
        load = _Job(2, ["load"], log)
        assert pool.submit(load, is_load=True)
        assert load.started.wait(10)  # served at once by the load thread
        assert not queued.started.is_set()  # ... which did not take the store
        gate.set()
        assert sorted(_drain(pool)) == [0, 1, 2]
        assert log.index("load") < log.index("store-queued")
    finally:
        pool.shutdown()


def _wait_for(cond: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


@pytest.mark.parametrize("store_threads", [2, 0])
def test_stores_flowing_are_polled_for_not_woken(store_threads: int) -> None:
    """While stores flow, submitting one posts no wake-up (the scheduler
    thread's costliest step) and it still starts within the poll period;
    once they stop for ``store_linger_s`` the workers block again and a
    store wakes one as before. With no store threads a load thread polls."""
    pool = IOPool(2, store_threads, 100, ctx_factory=lambda: None,
                  store_poll_s=0.005, store_linger_s=0.3)
    poll_group = pool._store_poll_group
    log: list[str] = []
    try:
        first = _Job(1, ["s1"], log)
        assert pool.submit(first, is_load=False)
        assert first.started.wait(10)
        assert _wait_for(lambda: pool._polling_stores)  # an idle worker now polls
        second = _Job(2, ["s2"], log)
        assert pool.submit(second, is_load=False)
        assert poll_group.wake.qsize() == 0  # no token posted for it ...
        assert second.started.wait(10)  # ... and it runs all the same
        # A load is still woken for at once, poller or not.
        load = _Job(3, ["l"], log)
        assert pool.submit(load, is_load=True)
        assert load.started.wait(10)
        # Stores stop: after the linger nobody polls; a store wakes a sleeper.
        assert _wait_for(lambda: not pool._polling_stores and poll_group.sleeping > 0)
        time.sleep(0.05)
        assert not pool._polling_stores
        third = _Job(4, ["s3"], log)
        assert pool.submit(third, is_load=False)
        assert third.started.wait(10)
        assert sorted(_drain(pool)) == [1, 2, 3, 4]
        assert sorted(log) == ["l", "s1", "s2", "s3"]
    finally:
        pool.shutdown()


def test_shutdown_stops_a_polling_worker() -> None:
    pool = IOPool(1, 1, 100, ctx_factory=lambda: None, name="kvstore_poll",
                  store_poll_s=0.2, store_linger_s=60.0)
    job = _Job(1, ["s"], [])
    assert pool.submit(job, is_load=False)
    assert job.started.wait(10)
    assert _wait_for(lambda: pool._polling_stores)
    # The poller sees the stop within one period; one that missed it would
    # keep shutdown's join waiting until pytest-timeout fails the test.
    pool.shutdown()
    assert not [t for t in threading.enumerate() if t.name.startswith("kvstore_poll")]


class _Mortal(_Job):
    """Records the thread that deallocates it."""

    def __init__(self, job_id: int, died_on: list[str]) -> None:
        super().__init__(job_id, ["x"], [])
        self.died_on = died_on

    def __del__(self) -> None:
        self.died_on.append(threading.current_thread().name)


def test_retired_jobs_are_deallocated_by_a_worker_not_the_owner() -> None:
    pool = IOPool(1, 1, 100, ctx_factory=lambda: None, name="retire_io")
    died_on: list[str] = []
    try:
        assert pool.submit(_Mortal(1, died_on), is_load=True)
        pool.wait_idle()
        pool.retired.append(pool.finished.popleft())  # reported: handed back
        assert pool.submit(_Job(2, ["next"], []), is_load=True)  # a worker's next batch
        pool.wait_idle()
    finally:
        # A worker clears the retired jobs after accounting a batch and before
        # it takes the next, so once the threads are joined job 1 is gone;
        # had no worker cleared it, shutdown's own clear frees it here.
        pool.shutdown()
    assert died_on and died_on[0].startswith("retire_io_")
    assert not pool.retired
