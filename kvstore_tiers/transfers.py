"""Transfers: the jobs the I/O pool runs for a tier, and what they report back.

A :class:`Job` is one vLLM store or load job in flight. The pool runs its
slots on I/O threads (:meth:`Job.run`); the thread that accounts its last
slot condenses the per-slot outcomes into a :class:`Summary` with vLLM's
``JobResult`` (and kv event) ready (:meth:`Job.finish`). The scheduler side
(:mod:`kvstore_tiers.tier`) only applies summaries. A job never holds its
tier: everything it needs -- the backend, the rows of vLLM's primary view,
the namespace's object naming, the tier's label and whether it emits events
-- comes in one :class:`TransferContext`, immutable and shared by all the
tier's jobs; the per-thread :class:`~kvstore_tiers.frame.FrameCodec` comes
from the pool. :class:`ExistenceCheck`, the other work done off the
scheduler thread (vLLM's lookup worker), gets the same context.

Load deadlines (``load_timeout_s``): a load job that has not finished by its
deadline is reported failed from the next ``get_finished_jobs()`` -- on the
scheduler thread, without waiting for the I/O thread, which may still be
stuck inside the backend (a stalled socket, a hung NFS read). Rows are
protected by a bounce-buffer protocol:

* with a deadline configured, backends never write a primary row: each load
  task decodes into a per-thread, page-aligned bounce buffer;
* a verified row is then copied into its primary row while holding the
  job's ``lock``, and only if the job is not ``expired``; the slot is marked
  ``landed`` inside the same critical section;
* expiring a job (:func:`expire`) takes the same lock, sets ``expired`` and
  reports exactly the ``landed`` slots as ``successful_keys`` (vLLM keeps
  those rows and frees the rest at once).

So after the lock is released by the scheduler no I/O thread ever writes a
row of that job again: a late thread finds ``expired`` and discards its
bounce buffer, and its eventual pool completion is ignored (``reported``).
The scheduler holds the lock for at most one row copy. Without
``load_timeout_s`` loads decode straight into the rows (one copy less) and a
stuck backend is bounded only by its own socket timeouts. Stores are never
expired early: their I/O thread reads the pinned row, so reporting them
before it is done could let vLLM reuse the row mid-read; they rely on the
backend's timeouts.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.kv_offload.base import Locality, Medium, OffloadingEvent, OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult

from kvstore_tiers.backends.base import Backend, LoadItem, StoreItem, classify
from kvstore_tiers.errors import ObjectCorrupt, ObjectMissing, TransientError, detached
from kvstore_tiers.frame import FrameCodec
from kvstore_tiers.pool import PoolJob
from kvstore_tiers.ratelimit import RateLimitedLogger


class Cancelled(TransientError):
    """A slot cancelled before it started (drain, ``reset_cache``, shutdown).

    Reported failed to vLLM like any failed slot, but it says nothing of the
    backend's health: it never feeds the circuit breaker.
    """


class PrimaryRows:
    """vLLM's primary KV view as rows of ``row_bytes`` (I/O threads read and write them).

    The tier releases it at shutdown; no row is handed out after that.
    """

    __slots__ = ("_flat", "count", "row_bytes")

    def __init__(self, view: memoryview, row_bytes: int) -> None:
        self.count = int(view.shape[0]) if view.shape else 0
        self.row_bytes = row_bytes
        self._flat: memoryview | None = view.cast("B")

    def __getitem__(self, chunk_id: int) -> memoryview:
        assert self._flat is not None
        off = chunk_id * self.row_bytes
        return self._flat[off : off + self.row_bytes]

    def release(self) -> None:
        if self._flat is not None:
            with contextlib.suppress(Exception):
                self._flat.release()
            self._flat = None


@dataclass(frozen=True, slots=True)
class TransferContext:
    """What every job of one tier needs, built once by the tier and shared."""

    backend: Backend
    rows: PrimaryRows
    object_name: Callable[[bytes], str]
    label: str  # the tier type, for log lines
    medium: Medium
    locality: Locality
    emit_events: bool  # build a kv event for every successful store
    warn: RateLimitedLogger
    #: Counts a load's blocks as admission sightings (the policy's ``seen``;
    #: None with ``admission: always``), called by the I/O thread that runs
    #: the load's first batch, so vLLM's scheduler thread never pays for it.
    load_sightings: Callable[[list[bytes]], None] | None = None
    #: Decides which of a store job's blocks are written (the policy's
    #: ``admit``; None with ``admission: always``), called by :meth:`Job.start`.
    admit: Callable[[list[bytes]], list[int] | None] | None = None
    #: Per-I/O-thread bounce buffers of deadlined loads (``.buf``).
    bounce: threading.local = field(default_factory=threading.local)


#: A store slot's outcome when the admission policy chose not to write its block.
NOT_ADMITTED = object()


class Job(PoolJob):
    """A vLLM job in flight: the keys the pool moves and their outcomes.

    Slot ``s`` is block ``keys[s]`` in primary row ``cids[s]`` (for stores,
    only the keys that were not already stored or in flight). The I/O thread
    that runs a slot writes ``outcomes[s]`` (``None`` loaded, ``True``/
    ``False`` stored/existed, or the backend error) and ``stored_bytes[s]``;
    the thread that finishes the job condenses them into ``summary``, so the
    scheduler thread applies a finished job with a few bulk operations.

    Store admission (``ctx.admit``) is decided here, off the scheduler
    thread: :meth:`start`, which the pool calls exactly once before any slot
    runs, asks the policy and marks the slots it does not admit
    :data:`NOT_ADMITTED` (``skips`` counts them); no thread writes them, and
    the summary hands their keys back as ``skipped``, neither stored nor
    failed. Their rows stay pinned until the job is reported, as any
    store's. A job started only to be cancelled asks nothing.

    Built on vLLM's scheduler thread, so it allocates as little as it can
    there (see :class:`~kvstore_tiers.pool.PoolJob`): ``keys`` is vLLM's own
    key list (vLLM reads it again when the job completes, so nobody mutates
    it meanwhile), ``ctx`` is shared by every job of the tier, the per-slot
    lists are made by :meth:`start` on an I/O thread, and a store job is its
    own presence-index receipt (``done``). Only a load with a deadline gets
    its ``lock`` and ``landed`` at once: the scheduler may expire it before
    any I/O thread took it.
    """

    __slots__ = ("cids", "ctx", "deadline", "done", "expired", "is_load", "keys", "landed",
                 "lock", "outcomes", "reported", "req_id", "skips", "stored_bytes",
                 "submit_time", "summary")

    def __init__(
        self, ctx: TransferContext, job_id: int, *, is_load: bool, req_id: str,
        keys: Sequence[bytes], cids: Sequence[int], submit_time: float, deadline: float | None,
        batch: int,
    ) -> None:
        PoolJob.__init__(self, job_id, len(keys), batch)  # not super(): one object less
        self.ctx = ctx
        self.is_load = is_load
        self.req_id = req_id
        self.keys = keys
        self.cids = cids
        self.outcomes: list[Any] | tuple[()] = ()  # made by start()
        self.stored_bytes: list[int] | tuple[()] = ()  # frame bytes moved, per slot
        self.submit_time = submit_time
        self.deadline = deadline
        # Deadline protocol (module docstring): ``landed[slot]`` and ``expired``
        # change only under ``lock``; ``reported`` is scheduler-thread only.
        self.lock = threading.Lock() if deadline is not None else None
        self.landed: list[bool] | tuple[()] = [False] * len(keys) if deadline is not None else ()
        self.expired = False
        self.reported = False
        self.summary: Summary | None = None
        #: Stores: this job is the presence index's receipt for its keys.
        self.done = False
        #: Stores: slots the admission policy did not admit (set by start()).
        self.skips = 0

    def start(self, runs: bool) -> None:
        """Make the per-slot lists; for a store job that will run, ask the
        admission policy which blocks to write and mark the others
        :data:`NOT_ADMITTED` (a job started only to be cancelled, at drain
        or shutdown, asks nothing: every block of it is cancelled)."""
        n = self.n_slots
        self.stored_bytes = [0] * n
        self.outcomes = [None] * n
        if runs and not self.is_load and self.ctx.admit is not None:
            self._admit()

    def _admit(self) -> None:
        """Ask the admission policy, once; mark the slots it does not admit.

        Under the pool's lock (see :meth:`PoolJob.start`), so the policy is
        called by one thread at a time. Best effort: a policy that fails, or
        answers an index out of range, admits the whole job (it is logged,
        rate-limited), never takes the I/O thread down.
        """
        keys = self.keys if type(self.keys) is list else list(self.keys)
        try:
            admitted = self.ctx.admit(keys)  # type: ignore[misc]
            if admitted is None:
                return
            outcomes = [NOT_ADMITTED] * self.n_slots
            for i in admitted:
                outcomes[i] = None
        except Exception as exc:
            self.ctx.warn.warning("admission", "kvstore tier %s: store admission failed; "
                                  "writing the job's blocks: %r", self.ctx.label, exc)
            return
        self.outcomes = outcomes
        self.skips = outcomes.count(NOT_ADMITTED)

    def run(self, codec: FrameCodec, start: int, stop: int) -> None:
        run_slots(self, codec, start, stop)
        if start == 0 and self.is_load and self.ctx.load_sightings is not None:
            # After the batch's reads, which the request waits for. Best
            # effort: a sighting not counted only delays an admission.
            try:
                self.ctx.load_sightings(list(self.keys))
            except Exception as exc:
                self.ctx.warn.warning("sightings", "kvstore tier %s: counting a load's "
                                      "admission sightings failed: %r", self.ctx.label, exc)

    def cancel(self, start: int, stop: int) -> None:
        err = Cancelled("cancelled before it started (drain or shutdown)")
        outcomes = self.outcomes
        for s in range(start, stop):
            if outcomes[s] is not NOT_ADMITTED:
                outcomes[s] = err

    def finish(self) -> None:
        self.summary = summarise(self)
        # Drop the per-slot lists here, on the I/O thread: the scheduler only
        # reads the summary, and deallocating their ~50 objects there, cold
        # in its cache, made up much of a job's completion cost. (``landed``
        # stays: an expiring load reads it under ``lock``.)
        self.outcomes, self.stored_bytes, self.cids = (), (), ()

    def release(self) -> None:
        """Scheduler thread, once reported: drop what a receipt need not keep.

        A store job stays referenced by the presence index as its keys'
        receipt; only ``done`` matters then.
        """
        self.keys, self.summary = (), None


@dataclass(slots=True)
class Summary:
    """A finished job's outcomes, condensed off the scheduler thread."""

    ok: list[bytes]  # stored (written or already there) / loaded
    bad: list[bytes]  # failed (cancelled ones included)
    #: Stores: not admitted (neither stored nor failed); empty: every block was offered.
    skipped: list[bytes] | tuple[()] = ()
    written: int = 0  # stores that wrote an object
    existed: int = 0  # stores that found the object already there
    frame_bytes: int = 0  # frame bytes written (new objects) or read (loaded)
    missing: int = 0  # loads: object gone
    corrupt: int = 0  # loads: object rejected (and removed)
    transient: int = 0  # I/O or service errors (they feed the circuit breaker)
    cancelled: int = 0  # cancelled before they started (never feed the breaker)
    #: Loads: the keys of the cancelled slots (their objects are untouched).
    cancelled_keys: list[bytes] | tuple[()] = ()
    first_error: BaseException | None = None
    first_corrupt: BaseException | None = None
    #: vLLM's records, built on the finishing I/O thread (see :func:`summarise`).
    result: JobResult | None = None
    event: OffloadingEvent | None = None

    @classmethod
    def of(cls, job: Job) -> Summary:
        n = len(job.keys)
        # The common case in C (this runs holding the GIL the scheduler wants).
        # ``ok`` is the job's own key list (never mutated): no copy.
        if job.is_load and job.outcomes.count(None) == n:
            return cls(job.keys, [], frame_bytes=sum(job.stored_bytes))
        if not job.is_load and job.outcomes.count(True) == n:
            return cls(job.keys, [], written=n, frame_bytes=sum(job.stored_bytes))
        s = cls([], [], [] if job.skips else (), cancelled_keys=[] if job.is_load else ())
        for key, res, nbytes in zip(job.keys, job.outcomes, job.stored_bytes, strict=True):
            if res is NOT_ADMITTED:
                s.skipped.append(key)  # type: ignore[union-attr]
                continue
            if not isinstance(res, BaseException):
                s.ok.append(key)
                if res is False and not job.is_load:
                    s.existed += 1
                else:
                    s.written += not job.is_load
                    s.frame_bytes += nbytes
                continue
            s.bad.append(key)
            if isinstance(res, Cancelled):
                s.cancelled += 1
                if job.is_load:
                    s.cancelled_keys.append(key)  # type: ignore[union-attr]
            elif isinstance(res, ObjectMissing):
                s.missing += 1
            elif isinstance(res, ObjectCorrupt):
                s.corrupt += 1
                s.first_corrupt = s.first_corrupt or res
            else:
                s.transient += isinstance(res, TransientError) or job.is_load
                s.first_error = s.first_error or res
        return s


class TouchJob(PoolJob):
    """Background refresh of recency/expiry (``Backend.touch_many``); no vLLM job."""

    __slots__ = ("backend", "names")

    def __init__(self, backend: Backend, names: list[str]) -> None:
        super().__init__(-1, len(names), len(names))
        self.backend = backend
        self.names = names

    def run(self, codec: FrameCodec, start: int, stop: int) -> None:
        with contextlib.suppress(Exception):  # best effort: a failed touch only ages a key
            self.backend.touch_many(self.names[start:stop])

    def cancel(self, start: int, stop: int) -> None:
        return


class ExistenceCheck(AsyncLookupManager):
    """vLLM's AsyncLookupManager over ``Backend.exists_many`` (its worker thread)."""

    def __init__(self, ctx: TransferContext) -> None:
        super().__init__(tier_type=ctx.label)
        self._ctx = ctx

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> list[bool]:
        names = [self._ctx.object_name(k) for k in keys]
        # A list, never a generator: vLLM 0.32 iterates it outside its try.
        return [bool(x) for x in self._ctx.backend.exists_many(names)]


# -- on an I/O thread ------------------------------------------------------------------
def run_slots(job: Job, codec: FrameCodec, start: int, stop: int) -> None:
    """Move slots ``[start, stop)`` of ``job`` through its backend; record outcomes."""
    ctx = job.ctx
    try:
        if job.is_load and job.deadline is not None:
            _run_deadlined_load(job, codec, start, stop)
            return
        name_of, rows = ctx.object_name, ctx.rows
        if job.is_load:
            keys = job.keys[start:stop]
            views = [rows[c] for c in job.cids[start:stop]]
            items = [LoadItem(name_of(k), k, r) for k, r in zip(keys, views, strict=True)]
            results = ctx.backend.load_many(items, codec)
            for s, item, res in zip(range(start, stop), items, results, strict=True):
                if isinstance(res, BaseException):
                    job.outcomes[s] = detached(res)
                    if isinstance(res, ObjectCorrupt):
                        _remove_corrupt(ctx, item.name)
                else:
                    job.stored_bytes[s] = res
        else:
            keys, cids, outcomes = job.keys, job.cids, job.outcomes
            slots: Sequence[int] = range(start, stop)
            if job.skips:
                slots = [s for s in slots if outcomes[s] is not NOT_ADMITTED]
                if not slots:
                    return
            sitems = [StoreItem(name_of(keys[s]), keys[s], rows[cids[s]]) for s in slots]
            results = ctx.backend.store_many(sitems, codec)
            for s, res in zip(slots, results, strict=True):
                if isinstance(res, BaseException):
                    outcomes[s] = detached(res)
                else:
                    outcomes[s] = res > 0  # frame bytes written; 0: it existed
                    job.stored_bytes[s] = res
    except Exception as exc:
        # The batch call itself failed: no slot of it can be trusted.
        err = detached(classify(exc))
        for s in range(start, stop):
            if job.outcomes[s] is not NOT_ADMITTED:
                job.outcomes[s] = err


def _bounce(ctx: TransferContext, n_rows: int) -> mmap.mmap:
    """This thread's page-aligned scratch of at least ``n_rows`` rows.

    Anonymous mmap memory is page aligned, so O_DIRECT reads into it work
    exactly as into the (aligned) primary rows.
    """
    need = max(1, n_rows * ctx.rows.row_bytes)
    buf: mmap.mmap | None = getattr(ctx.bounce, "buf", None)
    if buf is None or len(buf) < need:
        # The old buffer is dropped, not closed: views of it may still be alive.
        buf = ctx.bounce.buf = mmap.mmap(-1, need)
    return buf


def _run_deadlined_load(job: Job, codec: FrameCodec, start: int, stop: int) -> None:
    """Load into a bounce buffer, then copy rows in unless expired (module docstring)."""
    if job.expired or time.monotonic() > (job.deadline or 0.0):
        raise TimeoutError("load deadline passed before the transfer started")
    ctx = job.ctx
    row = ctx.rows.row_bytes
    # Views of the scratch are not released explicitly: a codec may still
    # hold an export of them; the mmap lives as long as this thread.
    scratch = memoryview(_bounce(ctx, stop - start))
    name_of = ctx.object_name
    items = [LoadItem(name_of(k), k, scratch[i * row : (i + 1) * row])
             for i, k in enumerate(job.keys[start:stop])]
    results = ctx.backend.load_many(items, codec)
    late = TimeoutError("load finished after its deadline; discarded")
    for s, item, res in zip(range(start, stop), items, results, strict=True):
        if isinstance(res, BaseException):
            job.outcomes[s] = detached(res)
            if isinstance(res, ObjectCorrupt):
                _remove_corrupt(ctx, item.name)
            continue
        job.stored_bytes[s] = res
        assert job.lock is not None  # a deadlined job has one from the start
        with job.lock:
            if job.expired:
                job.outcomes[s] = late
                continue
            ctx.rows[job.cids[s]][:] = item.dest
            job.landed[s] = True
            job.outcomes[s] = None


def _remove_corrupt(ctx: TransferContext, name: str) -> None:
    """Delete a corrupt object so no later lookup finds it."""
    try:
        ctx.backend.delete(name)
    except Exception as exc:
        ctx.warn.warning(
            "corrupt-delete", "kvstore tier %s: could not remove corrupt object %s: %s",
            ctx.label, name, exc,
        )


def summarise(job: Job) -> Summary:
    """Condense a finished job, with its JobResult and kv event ready.

    Runs on the finishing I/O thread; reads only the job and its context.
    """
    ctx = job.ctx
    s = Summary.of(job)
    if not job.is_load:
        # Only the blocks offered to the backend moved. None (all skipped):
        # bytes and time 0, which vLLM's backpressure detector ignores
        # rather than counting as a store that took no time.
        offered = len(job.keys) - len(s.skipped)
        s.result = JobResult(
            job_id=job.job_id, success=not s.bad,
            transfer_time=job.transfer_time if offered else 0.0,
            transfer_bytes=offered * ctx.rows.row_bytes,
        )
        if ctx.emit_events and s.ok:
            s.event = OffloadingEvent(
                keys=s.ok, medium=ctx.medium, removed=False, locality=ctx.locality,
            )
    elif s.bad:
        s.result = JobResult(
            job_id=job.job_id, success=False, successful_keys=tuple(s.ok) or None,
            transfer_time=job.transfer_time,
        )
    else:
        s.result = JobResult(job_id=job.job_id, success=True, transfer_time=job.transfer_time)
    return s


# -- on the scheduler thread -------------------------------------------------------------
def expire(job: Job) -> tuple[list[bytes], list[bytes]]:
    """Mark a deadlined load ``expired``; its (landed, not landed) keys.

    Holds the job's lock for at most one row copy. After it returns no I/O
    thread writes this job's rows again (module docstring).
    """
    assert job.lock is not None  # only loads with a deadline expire
    with job.lock:
        job.expired = True
        landed = list(job.landed)
    job.reported = True
    ok = [k for k, done in zip(job.keys, landed, strict=True) if done]
    bad = [k for k, done in zip(job.keys, landed, strict=True) if not done]
    return ok, bad
