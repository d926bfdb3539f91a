"""The I/O pool: load priority, per-chunk parallelism, bounded queue, cancellation."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from kvstore_tiers.pool import IOPool, PoolJob


@dataclass(eq=False)
class _Task:
    job: PoolJob
    label: str
    log: list[str]
    n_chunks: int = 1
    gate: threading.Event | None = None
    barrier: threading.Barrier | None = None
    cancelled: list[str] = field(default_factory=list)
    started: threading.Event = field(default_factory=threading.Event)

    def run(self, ctx: Any) -> None:
        self.started.set()
        if self.gate is not None:
            self.gate.wait(10)
        if self.barrier is not None:
            self.barrier.wait(10)  # only passes if all parties run at once
        self.log.append(self.label)

    def cancel(self) -> None:
        self.cancelled.append(self.label)


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
        blocker = _Task(PoolJob(0), "blocker", log, gate=gate)
        assert pool.submit([blocker], False)
        assert blocker.started.wait(10)  # the only thread is now busy
        assert pool.submit([_Task(PoolJob(1), "store", log)], is_load=False)
        assert pool.submit([_Task(PoolJob(2), "load", log)], is_load=True)
        gate.set()
        pool.wait_idle()
        assert log == ["blocker", "load", "store"]
    finally:
        pool.shutdown()


def test_one_jobs_chunks_move_in_parallel() -> None:
    """A single request's chunks are spread over threads (vLLM's fs pool uses one)."""
    pool = IOPool(4, 0, 100, ctx_factory=lambda: None)
    log: list[str] = []
    job = PoolJob(7)
    barrier = threading.Barrier(4)
    try:
        tasks = [_Task(job, f"c{i}", log, barrier=barrier) for i in range(4)]
        assert pool.submit(tasks, is_load=True)
        assert _drain(pool) == [7]  # exactly one completion for the job
        assert sorted(log) == ["c0", "c1", "c2", "c3"]
        assert not barrier.broken
    finally:
        pool.shutdown()


def test_bounded_queue_refuses_instead_of_blocking() -> None:
    pool = IOPool(1, 0, max_queued_chunks=3, ctx_factory=lambda: None)
    gate = threading.Event()
    log: list[str] = []
    try:
        blocker = _Task(PoolJob(0), "b", log, gate=gate)
        assert pool.submit([blocker], True)
        assert blocker.started.wait(10)
        assert pool.submit([_Task(PoolJob(9), "probe", log)], True)
        # The blocker holds the only thread; "probe" (1 chunk) is queued, so
        # 2 more chunks fit and a third does not.
        assert pool.submit([_Task(PoolJob(1), "x", log, n_chunks=2)], True)
        assert not pool.submit([_Task(PoolJob(2), "y", log)], True)
        gate.set()
        assert sorted(_drain(pool)) == [0, 1, 9]
    finally:
        pool.shutdown()


def test_cancelled_tasks_still_complete_their_job() -> None:
    pool = IOPool(1, 0, 100, ctx_factory=lambda: None)
    gate = threading.Event()
    log: list[str] = []
    try:
        blocker = _Task(PoolJob(0), "b", log, gate=gate)
        assert pool.submit([blocker], True)
        assert blocker.started.wait(10)
        job = PoolJob(1)
        queued = [_Task(job, f"q{i}", log) for i in range(3)]
        assert pool.submit(queued, is_load=False)
        assert pool.cancel_queued() == 3
        assert [t.cancelled for t in queued] == [["q0"], ["q1"], ["q2"]]
        gate.set()
        assert sorted(_drain(pool)) == [0, 1]
        assert log == ["b"]  # cancelled tasks never ran
    finally:
        pool.shutdown()


def test_shutdown_joins_every_thread() -> None:
    pool = IOPool(3, 2, 100, ctx_factory=lambda: None, name="kvstore_unit")
    pool.shutdown()
    assert not [t for t in threading.enumerate() if t.name.startswith("kvstore_unit")]
    assert not pool.submit([_Task(PoolJob(1), "late", [])], True)  # refused, never hangs
