"""The I/O thread pool: loads before stores, per-chunk work, bounded queue.

vLLM's stock fs pool runs a whole job on one thread, which caps a single
request's load at one thread's bandwidth. Here a job of ``n`` chunks is
queued *once* and taken apart by the threads themselves: each takes the
next ``batch`` chunks of the job at the head of the queue, so one request's
chunks move in parallel while the scheduler thread pays for one queue entry
and one wake-up per job, whatever its size (vLLM calls ``submit_*`` on its
scheduler thread; per-chunk task objects cost it microseconds per chunk).

Two groups of threads share two queues: load-priority threads take loads
first (loads sit on time-to-first-token) and stores only when no load is
queued; store-priority threads do the reverse, so stores are never starved.

The queue is bounded in chunks: :meth:`IOPool.submit` refuses a job that
does not fit rather than blocking the scheduler thread. Chunks cancelled at
drain or shutdown go through the job's ``cancel()``, which records a failure
for them, so their job still completes and reports.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from queue import SimpleQueue
from typing import Any

logger = logging.getLogger(__name__)


class PoolJob:
    """``n_slots`` chunks of work, run ``batch`` at a time on any pool thread.

    Subclasses implement :meth:`run` and :meth:`cancel`, which must record
    the outcome of every slot they are given (they are never given a slot
    twice), and may implement :meth:`start` and :meth:`finish`.

    :meth:`start` is called exactly once, before any slot is run or
    cancelled, under the pool's lock, by the I/O thread that takes the
    job's first batch (``runs=True``), or by the thread cancelling a job
    never taken (``runs=False``: drain or shutdown, maybe vLLM's scheduler
    thread; no slot of it will run). Per-slot state belongs there, not in
    ``__init__``: the submitting thread is vLLM's scheduler, and every
    container it allocates counts towards CPython's next cyclic-GC pass,
    which runs (100-150 us on the test VM) in whichever thread allocates
    past the threshold.

    :meth:`finish` is called exactly once, on the thread that accounts the
    last slot, before the job appears in :attr:`IOPool.finished`: an I/O
    thread, or, for a job whose last slots were cancelled, the thread
    calling :meth:`IOPool.cancel_queued` (drain or shutdown, which may block
    by vLLM's contract).
    """

    __slots__ = ("_next", "_remaining", "batch", "job_id", "n_slots", "transfer_time")

    def __init__(self, job_id: int, n_slots: int, batch: int = 1) -> None:
        if n_slots < 1 or batch < 1:
            raise ValueError("a job needs at least one slot and a batch of at least one")
        self.job_id = job_id
        self.n_slots = n_slots
        self.batch = batch
        self.transfer_time = 0.0  # summed over batches (thread-seconds)
        self._next = 0  # first slot not yet handed out (pool lock)
        self._remaining = n_slots  # slots not yet accounted (pool lock)

    def start(self, runs: bool) -> None:
        """Called once before the first slot runs or is cancelled (see the class doc).

        ``runs``: False when the job is started only to be cancelled. Runs
        under the pool's lock: allocate, do not wait on anything or raise.
        A job that will run may :meth:`narrow` itself here.
        """

    def narrow(self, n_slots: int) -> None:
        """From :meth:`start` only: the job has ``n_slots`` slots (0 or more),
        fewer than it was queued with; the pool drops the rest from its count
        of queued chunks, and a job left with none finishes at once."""
        assert 0 <= n_slots <= self.n_slots and self._next == 0
        self.n_slots = self._remaining = n_slots

    def run(self, ctx: Any, start: int, stop: int) -> None:
        """Do slots ``[start, stop)`` (I/O thread); record their outcomes."""
        raise NotImplementedError

    def cancel(self, start: int, stop: int) -> None:
        """Record slots ``[start, stop)`` as failed without running them."""
        raise NotImplementedError

    def finish(self) -> None:
        """Called once when every slot is accounted (see the class docstring)."""

    def settle(self, ledger: Any) -> Any:
        """Called once on the thread that takes the job from
        :attr:`IOPool.finished` (the tier's scheduler thread): apply the job to
        the tier's ``ledger``; what to report to vLLM, or None (a background
        job no one waits for). The completion protocol of every job: the taker
        asks no job its class."""
        return None


class _Group:
    """Workers that serve the same queues, in the same order, and sleep on one wake queue."""

    __slots__ = ("queues", "sleeping", "wake")

    def __init__(self, queues: tuple[deque[PoolJob], ...]) -> None:
        self.queues = queues
        self.sleeping = 0  # workers blocked on ``wake`` (written under the pool lock)
        self.wake: SimpleQueue[None] = SimpleQueue()


class IOPool:
    """Fixed pool of I/O threads with a load queue and a store queue.

    ``ctx_factory`` builds one per-thread context (codec state, aligned
    buffers) passed to every ``job.run(ctx, start, stop)`` on that thread.

    Load threads take only loads; store threads take stores first and loads
    when no store is queued. So a load never waits behind stores occupying
    every thread (a 2 MiB O_DIRECT write takes milliseconds), and stores go
    at most ``n_store_threads`` wide, which on a disk is as fast as going
    wider (more concurrent large writes only queue in the device). A pool
    without store threads lets its load threads take stores too.

    The submitting (scheduler) thread takes no lock: it appends to a deque
    and, if a worker that serves that queue sleeps, puts a token on that
    group's ``SimpleQueue`` (both are atomic C calls). Workers share
    ``_lock`` among themselves. A lock the scheduler shared with twelve I/O
    threads would make it queue behind whichever of them holds the lock
    *and* waits for the GIL.

    No lost wake-up: a worker counts itself as sleeping before its last look
    at its queues, and ``submit`` looks at the sleeping counts after its
    append, so one of the two sees the other. A surplus token only costs a
    spurious wake-up.

    Stores are picked up without a wake-up while they flow. Waking a blocked
    thread is the one costly thing ``submit`` does: a futex wake and, on a
    VM, an inter-processor interrupt to the idle vCPU, measured at 30 us
    (p50) to 80 us (p99) on the 2-vCPU test VM, against ~12 us for the rest
    of a 16-chunk ``submit_store``. Loads sit on time-to-first-token and are
    always woken for at once. A store only needs to start soon, so for
    ``store_linger_s`` after the last store was taken, one idle worker that
    serves the store queue polls it every ``store_poll_s`` instead of
    blocking (``_polling_stores``), and ``submit`` does not wake anyone for a
    store while it does. A store waits at most ``store_poll_s`` to start;
    the poller's wake-ups cost the process ~1/``store_poll_s`` GIL
    acquisitions a second while stores flow, none once they stop. Same
    ordering argument: the poller clears ``_polling_stores`` before it counts
    itself as sleeping and takes its last look, and ``submit`` reads it
    after its append.
    """

    def __init__(
        self,
        n_load_threads: int,
        n_store_threads: int,
        max_queued_chunks: int,
        ctx_factory: Callable[[], Any],
        name: str = "kvstore_io",
        *,
        store_poll_s: float = 0.002,
        store_linger_s: float = 5.0,
    ) -> None:
        self._load_q: deque[PoolJob] = deque()
        self._store_q: deque[PoolJob] = deque()
        loaders_store = n_store_threads == 0
        self._loaders = _Group((self._load_q, self._store_q) if loaders_store
                               else (self._load_q,))
        self._storers = _Group((self._store_q, self._load_q))
        #: Who may serve each queue, in the order a wake-up prefers them.
        self._load_servers = (self._loaders, self._storers)
        self._store_servers = (self._storers, self._loaders) if loaders_store \
            else (self._storers,)
        #: The group whose idle worker polls the store queue (see the class doc).
        self._store_poll_group = self._loaders if loaders_store else self._storers
        self._store_poll_s = store_poll_s
        self._store_linger_s = store_linger_s
        self._polling_stores = False  # a worker is polling the store queue (under _lock)
        self._last_store_taken = float("-inf")  # monotonic (under _lock)
        self._lock = threading.Lock()  # workers (and cancel/wait_idle); never in submit
        self._all_done = threading.Condition(self._lock)  # wait_idle waits here
        # Chunk and job counts: each counter has a single writer, so the
        # scheduler thread reads the difference without a lock.
        self._submitted_chunks = 0  # submit (scheduler thread)
        self._taken_chunks = 0  # workers and cancel_queued (under _lock)
        self._submitted_jobs = 0  # submit
        self._finished_jobs = 0  # under _lock
        self._max_queued_chunks = max_queued_chunks
        self._stop = False
        self._ctx_factory = ctx_factory
        #: Jobs whose last slot finished; appended by workers, popped by the owner.
        self.finished: deque[PoolJob] = deque()
        #: Jobs the owner is done with (it appends them after reporting them):
        #: a worker drops them once its next batch is accounted, so that their
        #: deallocation (job, summary, lists: about as much as the rest of a
        #: job's completion) does not run on vLLM's scheduler thread. The last
        #: ones wait for the next batch, or for the pool to go.
        self.retired: deque[PoolJob] = deque()
        self._threads = [
            threading.Thread(
                target=self._worker, args=(group,), name=f"{name}_{kind}{i}", daemon=True
            )
            for kind, group, n in (("l", self._loaders, n_load_threads),
                                   ("s", self._storers, n_store_threads))
            for i in range(n)
        ]
        for t in self._threads:
            t.start()

    @property
    def queued_chunks(self) -> int:
        return self._submitted_chunks - self._taken_chunks

    def submit(self, job: PoolJob, is_load: bool) -> bool:
        """Queue ``job``; False (nothing queued) if it does not fit or the pool is closed.

        Called from one thread at a time (vLLM's scheduler thread): no lock,
        one append and at most one wake-up token.
        """
        if self._stop or self.queued_chunks + job.n_slots > self._max_queued_chunks:
            return False
        self._submitted_jobs += 1
        self._submitted_chunks += job.n_slots
        if is_load:
            self._load_q.append(job)
            self._wake_one(self._load_servers)
        else:
            self._store_q.append(job)
            if not self._polling_stores:
                self._wake_one(self._store_servers)
        return True

    @staticmethod
    def _wake_one(groups: tuple[_Group, ...]) -> None:
        # One token wakes one sleeper; it passes the wake on if work remains
        # (see _take): one futex call per submit, whatever the job's size.
        for group in groups:
            if group.sleeping:
                group.wake.put(None)
                return

    def cancel_queued(self) -> int:
        """Cancel every chunk not yet started (their jobs report failure); returns how many."""
        with self._lock:
            cut = []
            for q in (self._load_q, self._store_q):
                while q:
                    job = q.popleft()
                    if job._next == 0:
                        job.start(runs=False)
                    cut.append((job, job._next))
                    self._taken_chunks += job.n_slots - job._next
                    job._next = job.n_slots
        for job, start in cut:
            try:
                job.cancel(start, job.n_slots)
            except Exception:  # pragma: no cover - cancel only records outcomes
                logger.exception("cancelling queued I/O failed")
            self._account(job, job.n_slots - start, 0.0)
        return sum(job.n_slots - start for job, start in cut)

    def wait_idle(self, warn_after_s: float = 5.0) -> None:
        """Block until no job is in flight, warning periodically while waiting."""
        start = time.monotonic()
        with self._all_done:
            while self._submitted_jobs != self._finished_jobs:
                if not self._all_done.wait(timeout=warn_after_s):
                    logger.warning(
                        "kvstore tier: still waiting for %d in-flight I/O jobs after %.0fs",
                        self._submitted_jobs - self._finished_jobs, time.monotonic() - start,
                    )

    def shutdown(self) -> None:
        """Cancel queued work, let running batches finish, join every thread. Idempotent."""
        self._stop = True
        self.cancel_queued()
        for group in (self._loaders, self._storers):
            for _ in self._threads:
                group.wake.put(None)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join()
        self.retired.clear()

    # -- internals ---------------------------------------------------------------
    def _account(self, job: PoolJob, n: int, elapsed: float) -> None:
        """Count ``n`` slots of ``job`` done; the call that counts its last one finishes it."""
        # The pool's lock rather than one per job: a lock is one more object
        # to allocate at submit, and this section is a few attribute updates.
        with self._lock:
            job.transfer_time += elapsed
            job._remaining -= n
            if job._remaining:
                return
        try:
            job.finish()
        except Exception:  # pragma: no cover - finish only summarises outcomes
            logger.exception("kvstore tier: finishing an I/O job failed")
        self.finished.append(job)
        with self._lock:
            self._finished_jobs += 1
            if self._finished_jobs == self._submitted_jobs:
                self._all_done.notify_all()

    def _take(self, group: _Group) -> tuple[PoolJob, int, int] | None:
        """Next batch of the job at the head of the group's first non-empty queue (None: stop)."""
        while True:
            with self._lock:
                if self._stop:
                    return None
                for q in group.queues:
                    if q:
                        job = q[0]
                        start = job._next
                        if start == 0:
                            queued = job.n_slots
                            job.start(runs=True)
                            self._taken_chunks += queued - job.n_slots  # narrowed
                        stop = job._next = min(start + job.batch, job.n_slots)
                        if stop == job.n_slots:
                            q.popleft()
                        if q is self._store_q:
                            self._last_store_taken = time.monotonic()
                        self._taken_chunks += stop - start
                        # Fan out: a sleeper takes the next batch.
                        if self._load_q:
                            self._wake_one(self._load_servers)
                        elif self._store_q:
                            self._wake_one(self._store_servers)
                        return job, start, stop
                poll = (group is self._store_poll_group and not self._polling_stores
                        and time.monotonic() - self._last_store_taken < self._store_linger_s)
                if poll:
                    self._polling_stores = True
                else:
                    group.sleeping += 1
            if poll:
                # A plain sleep, not ``wake.get(timeout=...)``: with other
                # threads blocked on the same SimpleQueue, CPython 3.11's
                # timed get can block for good (seen once in four bench
                # runs: it can take the queue's lock after its deadline and
                # then wait with a negative, i.e. endless, timeout). The
                # poller is not counted as sleeping, so no token is meant
                # for it; shutdown finds it within one period.
                time.sleep(self._store_poll_s)
                with self._lock:
                    self._polling_stores = False
                continue
            # Last look after counting ourselves as sleeping (see the class doc).
            if not (self._stop or any(group.queues)):
                group.wake.get()
            with self._lock:
                group.sleeping -= 1

    def _worker(self, group: _Group) -> None:
        ctx = self._ctx_factory()
        retired = self.retired
        while (work := self._take(group)) is not None:
            job, start, stop = work
            t0 = time.monotonic()
            try:
                job.run(ctx, start, stop)
            except Exception:
                # run() records per-slot outcomes itself; this is a bug guard.
                logger.exception("kvstore tier: I/O job raised")
                job.cancel(start, stop)
            self._account(job, stop - start, time.monotonic() - t0)
            del job, work  # a finished job's last reference may be the owner's
            if retired:
                retired.clear()
