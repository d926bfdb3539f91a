"""The I/O thread pool: loads before stores, per-chunk tasks, bounded queue.

vLLM's stock fs pool runs a whole job on one thread, which caps a single
request's load at one thread's bandwidth. Here a job is split into tasks of a
few chunks each (``Backend.max_batch``), so one request's chunks move in
parallel.

Two groups of threads share two queues: load-priority threads take loads
first (loads sit on time-to-first-token) and stores only when no load is
queued; store-priority threads do the reverse, so stores are never starved.

The queue is bounded in chunks: :meth:`IOPool.submit` refuses a job that
does not fit rather than blocking the scheduler thread. Tasks cancelled at
drain or shutdown run their ``cancel()``, which records a failure for their
chunks, so their job still completes and reports.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

logger = logging.getLogger(__name__)


class PoolJob:
    """Completion tracking for one vLLM job: done when all its tasks are."""

    __slots__ = ("_lock", "_remaining", "job_id", "transfer_time")

    def __init__(self, job_id: int) -> None:
        self.job_id = job_id
        self.transfer_time = 0.0
        self._remaining = 0
        self._lock = threading.Lock()

    def _add_tasks(self, n: int) -> None:
        self._remaining += n

    def _task_done(self, elapsed: float) -> bool:
        with self._lock:
            self.transfer_time += elapsed
            self._remaining -= 1
            return self._remaining == 0


class IOTask(Protocol):
    """A unit of pool work. ``run`` and ``cancel`` must record their own outcome."""

    job: PoolJob
    n_chunks: int

    def run(self, ctx: Any) -> None: ...

    def cancel(self) -> None: ...


class IOPool:
    """Fixed pool of I/O threads with a load queue and a store queue.

    ``ctx_factory`` builds one per-thread context (codec state, aligned
    buffers) passed to every ``task.run(ctx)`` on that thread.
    """

    def __init__(
        self,
        n_load_threads: int,
        n_store_threads: int,
        max_queued_chunks: int,
        ctx_factory: Callable[[], Any],
        name: str = "kvstore_io",
    ) -> None:
        self._load_q: deque[IOTask] = deque()
        self._store_q: deque[IOTask] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._queued_chunks = 0
        self._max_queued_chunks = max_queued_chunks
        self._inflight_jobs = 0
        self._idle = 0  # workers waiting for a task (guarded by _cond)
        self._stop = False
        self._ctx_factory = ctx_factory
        #: Jobs whose last task finished; appended by workers, popped by the owner.
        self.finished: deque[PoolJob] = deque()
        self._threads = [
            threading.Thread(
                target=self._worker, args=(load_first,), name=f"{name}_{kind}{i}", daemon=True
            )
            for kind, load_first, n in (("l", True, n_load_threads), ("s", False, n_store_threads))
            for i in range(n)
        ]
        for t in self._threads:
            t.start()

    @property
    def queued_chunks(self) -> int:
        return self._queued_chunks

    @property
    def num_threads(self) -> int:
        return len(self._threads)

    def submit(self, tasks: Sequence[IOTask], is_load: bool) -> bool:
        """Queue ``tasks`` (all of one job); False (nothing queued) if full or closed."""
        if not tasks:
            raise ValueError("a job needs at least one task")
        job = tasks[0].job
        if any(t.job is not job for t in tasks):
            raise ValueError("all tasks of one submit must belong to one job")
        n_chunks = sum(t.n_chunks for t in tasks)
        with self._cond:
            if self._stop or self._queued_chunks + n_chunks > self._max_queued_chunks:
                return False
            job._add_tasks(len(tasks))
            self._inflight_jobs += 1
            self._queued_chunks += n_chunks
            (self._load_q if is_load else self._store_q).extend(tasks)
            # Wake ONE idle thread; it wakes the next if work remains (see
            # _worker). Each wake-up is a futex call, and this runs on vLLM's
            # scheduler thread: chaining keeps that cost to one per submit.
            if self._idle:
                self._cond.notify(1)
        return True

    def cancel_queued(self) -> int:
        """Cancel every queued task (their jobs report failure); returns how many."""
        with self._cond:
            tasks = list(self._load_q) + list(self._store_q)
            self._load_q.clear()
            self._store_q.clear()
            self._queued_chunks = 0
        for task in tasks:
            try:
                task.cancel()
            except Exception:  # pragma: no cover - cancel only records outcomes
                logger.exception("cancelling an I/O task failed")
            self._finish(task, 0.0)
        return len(tasks)

    def wait_idle(self, warn_after_s: float = 5.0) -> None:
        """Block until no job is in flight, warning periodically while waiting."""
        start = time.monotonic()
        with self._cond:
            while self._inflight_jobs:
                if not self._cond.wait(timeout=warn_after_s):
                    logger.warning(
                        "kvstore tier: still waiting for %d in-flight I/O jobs after %.0fs",
                        self._inflight_jobs, time.monotonic() - start,
                    )

    def shutdown(self) -> None:
        """Cancel queued tasks, let running ones finish, join every thread. Idempotent."""
        self.cancel_queued()
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join()

    # -- internals ---------------------------------------------------------------
    def _finish(self, task: IOTask, elapsed: float) -> None:
        if task.job._task_done(elapsed):
            with self._cond:
                self.finished.append(task.job)
                self._inflight_jobs -= 1
                self._cond.notify_all()

    def _worker(self, load_first: bool) -> None:
        ctx = self._ctx_factory()
        while True:
            with self._cond:
                while not (self._stop or self._load_q or self._store_q):
                    self._idle += 1
                    try:
                        self._cond.wait()
                    finally:
                        self._idle -= 1
                if self._stop:
                    return
                first, second = (
                    (self._load_q, self._store_q) if load_first else (self._store_q, self._load_q)
                )
                task = first.popleft() if first else second.popleft()
                self._queued_chunks -= task.n_chunks
                if self._idle and (self._load_q or self._store_q):
                    self._cond.notify(1)  # fan out: the next idle thread takes the next task
            start = time.monotonic()
            try:
                task.run(ctx)
            except Exception:
                # run() records per-chunk outcomes itself; this is a bug guard.
                logger.exception("kvstore tier: I/O task raised")
                task.cancel()
            self._finish(task, time.monotonic() - start)
