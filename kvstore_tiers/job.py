"""A transfer in flight: the job the I/O pool runs for a tier, and its one load loop.

A :class:`Job` is one vLLM store or load job in flight. The pool runs its
slots on I/O threads (:meth:`Job.run`); the thread that accounts its last
slot condenses the per-slot outcomes into a
:class:`~kvstore_tiers.outcome.Summary` with vLLM's ``JobResult`` (and kv
event) ready (:meth:`Job.finish`). The scheduler side
(:mod:`kvstore_tiers.ledger`) only applies summaries. A job never holds its
tier: everything it needs -- the backend, the rows of vLLM's primary view,
the namespace's object naming, the tier's label and whether it emits events
-- comes in one :class:`TransferContext`, immutable and shared by all the
tier's jobs; the per-thread :class:`~kvstore_tiers.frame.FrameCodec` comes
from the pool. :class:`~kvstore_tiers.existence.ExistenceCheck`, the other work
done off the scheduler thread (vLLM's lookup worker), gets the same context.

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
* expiring a job (:meth:`Job.expire`) takes the same lock, sets ``expired`` and
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
from itertools import repeat
from typing import TYPE_CHECKING, Any, Protocol

from vllm.v1.kv_offload.base import Locality, Medium, OffloadingEvent
from vllm.v1.kv_offload.tiering.base import JobResult

from kvstore_tiers import batching
from kvstore_tiers.backends.base import Backend
from kvstore_tiers.batching import LoadItem, LoadMany, StoreItem, StoreMany
from kvstore_tiers.errors import Cancelled, ObjectCorrupt, classify, detached
from kvstore_tiers.frame import FrameCodec
from kvstore_tiers.loadtrace import LoadTrace
from kvstore_tiers.outcome import Summary
from kvstore_tiers.pool import PoolJob
from kvstore_tiers.presence import new_receipt
from kvstore_tiers.ratelimit import RateLimitedLogger

if TYPE_CHECKING:
    from kvstore_tiers.ledger import Ledger


class StoreFilter(Protocol):
    """A layer around a tier's store path: which blocks of a store job to write."""

    def keep(self, keys: list[bytes]) -> list[int] | None:
        """The indices of ``keys`` to write (ascending, in range; may be empty),
        None: all of them. Asked once per job that will run, by the I/O thread
        that starts it, one thread at a time (the pool's lock); never raises."""
        ...


class LoadObserver(Protocol):
    """Told of the rows a tier's loads verified and put in primary rows (I/O threads).

    ``loaded`` runs after each load batch and may append what it wants to
    keep to ``notes`` (the job's); ``offer`` runs once the job finished, with
    those notes. Neither may raise or block.
    """

    def loaded(self, notes: list[Any], items: Sequence[LoadItem], outcomes: Sequence[Any],
               cids: Sequence[int]) -> None: ...

    def offer(self, notes: list[Any]) -> None: ...

    def drain(self) -> None:
        """The observed tier drained (scheduler thread): vLLM may free the rows
        of what its loads put there before."""
        ...


class _Both:
    """Two load observers as one; each keeps its own notes of a job."""

    __slots__ = ("first", "second")

    def __init__(self, first: LoadObserver, second: LoadObserver) -> None:
        self.first, self.second = first, second

    def loaded(self, notes: list[Any], items: Sequence[LoadItem], outcomes: Sequence[Any],
               cids: Sequence[int]) -> None:
        if not notes:
            notes += [[], []]
        self.first.loaded(notes[0], items, outcomes, cids)
        self.second.loaded(notes[1], items, outcomes, cids)

    def offer(self, notes: list[Any]) -> None:
        for observer, kept in ((self.first, notes[0]), (self.second, notes[1])):
            if kept:
                observer.offer(kept)

    def drain(self) -> None:
        self.first.drain()
        self.second.drain()


def observe_both(first: LoadObserver | None, second: LoadObserver) -> LoadObserver:
    """``second``, told of loads as well as ``first`` (if any)."""
    return second if first is None else _Both(first, second)


class Rows(Protocol):
    """The rows a tier's jobs move blocks from and into, by chunk id (I/O threads)."""

    row_bytes: int

    def __getitem__(self, chunk_id: int) -> memoryview: ...

    def release(self) -> None:
        """No row is handed out after this."""
        ...


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
    rows: Rows  # vLLM's primary (PrimaryRows), or rows of the tier's own
    object_name: Callable[[bytes], str]
    label: str  # the tier type, for log lines
    medium: Medium
    locality: Locality
    emit_events: bool  # build a kv event for every successful store
    warn: RateLimitedLogger
    #: Chooses which of a store job's blocks are written (:class:`StoreFilter`),
    #: asked by :meth:`Job.start`; None: all of them.
    store_filter: StoreFilter | None = None
    #: Per-I/O-thread bounce buffers of deadlined loads (``.buf``).
    bounce: threading.local = field(default_factory=threading.local)
    #: The load trace (:mod:`kvstore_tiers.loadtrace`); None: off, and a load
    #: pays this one test for it.
    trace: LoadTrace | None = None
    #: Told of the rows each load verified (:class:`LoadObserver`), wired by
    #: whoever composes the tiers; None: no one listens, and a load pays this
    #: one test for it.
    observer: LoadObserver | None = None
    #: The batch calls of :mod:`kvstore_tiers.batching` bound to the backend
    #: (and the load trace's marks), once.
    store_many: StoreMany = field(init=False)
    load_many: LoadMany = field(init=False)

    def __post_init__(self) -> None:
        backend, mark = self.backend, None if self.trace is None else self.trace.mark
        object.__setattr__(self, "store_many",  # frozen: set once, here
                           lambda items, codec: batching.store_many(backend, items, codec))
        object.__setattr__(self, "load_many",
                           lambda items, codec: batching.load_many(backend, items, codec, mark))


class Job(PoolJob):
    """A vLLM job in flight: the keys the pool moves and their outcomes.

    Slot ``s`` is block ``keys[s]`` in primary row ``cids[s]`` (for stores,
    only the keys that were not already stored or in flight). The I/O thread
    that runs a slot writes ``outcomes[s]`` (``None`` loaded, ``True``/
    ``False`` stored/existed, or the backend error) and ``stored_bytes[s]``;
    the thread that finishes the job condenses them into ``summary``, so the
    scheduler thread applies a finished job with a few bulk operations.

    A store filter (``ctx.store_filter``) is asked off the
    scheduler thread before the job moves a block: :meth:`start` (once,
    before any slot runs) narrows the job to the keys it keeps; the others go
    to ``unwritten``, neither stored nor failed, and leave the presence index
    when the job is reported (their rows pinned until then, as any store's).

    Built on vLLM's scheduler thread, so it allocates as little as it can
    there (:class:`~kvstore_tiers.pool.PoolJob`): ``keys`` is vLLM's own list
    (vLLM reads it again at completion: nobody mutates it), ``ctx`` is the
    tier's, the per-slot lists are made by :meth:`start` on an I/O thread,
    and a store job carries its keys' presence-index receipt. Only a
    load with a deadline gets its ``lock`` and ``landed`` at once: the
    scheduler may expire it before any I/O thread took it.
    """

    __slots__ = ("cids", "ctx", "deadline", "expired", "is_load", "keys",
                 "landed", "lock", "notes", "offered", "outcomes", "receipt", "reported", "req_id",
                 "stored_bytes", "submit_time", "summary", "unwritten")

    def __init__(
        self, ctx: TransferContext, job_id: int, *, is_load: bool, req_id: str,
        keys: Sequence[bytes], cids: Sequence[int], submit_time: float, deadline: float | None,
        batch: int,
    ) -> None:
        PoolJob.__init__(self, job_id, len(keys), batch)  # not super(): one object less
        #: The blocks submitted (for a store, kept or not): n_slots before narrowing.
        self.offered = self.n_slots
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
        #: Stores: the presence index's receipt for its keys (settled once reported).
        self.receipt = None if is_load else new_receipt()
        #: Stores: the keys not to be written, neither stored nor failed (start()).
        self.unwritten: list[bytes] | tuple[()] = ()
        #: Loads with an observer: what it noted of each batch, handed to it at finish.
        self.notes: list[Any] | tuple[()] = ()

    def start(self, runs: bool) -> None:
        """For a store job that will run, ask the store filter which blocks to
        write and narrow the job to them (a job started only to be cancelled,
        at drain or shutdown, asks nothing: every block of it is cancelled);
        then make the per-slot lists."""
        if runs and not self.is_load and self.ctx.store_filter is not None:
            self._keep()
        n = self.n_slots
        self.stored_bytes = [0] * n
        self.outcomes = [None] * n
        if self.is_load and self.ctx.observer is not None:
            self.notes = []

    def _keep(self) -> None:
        """Narrow the job to the keys its store filter keeps (under the pool's lock,
        see :meth:`PoolJob.start`)."""
        keys = self.keys if type(self.keys) is list else list(self.keys)
        kept = self.ctx.store_filter.keep(keys)  # type: ignore[union-attr]
        if kept is None:
            return
        chosen = [False] * len(keys)
        for i in kept:
            chosen[i] = True
        if all(chosen):
            return
        self.unwritten = [k for k, c in zip(keys, chosen, strict=True) if not c]
        self.keys = [k for k, c in zip(keys, chosen, strict=True) if c]
        self.cids = [r for r, c in zip(self.cids, chosen, strict=True) if c]
        self.narrow(len(self.keys))

    def run(self, codec: FrameCodec, start: int, stop: int) -> None:
        if start == stop:  # a store job its filter kept none of
            return
        run_slots(self, codec, start, stop)

    def cancel(self, start: int, stop: int) -> None:
        err = Cancelled("cancelled before it started (drain or shutdown)")
        outcomes = self.outcomes
        for s in range(start, stop):
            outcomes[s] = err

    def summarise(self) -> Summary:
        """Condense this finished job, with its JobResult and kv event ready.

        Runs on the finishing I/O thread; reads only the job and its context.
        """
        ctx = self.ctx
        s = Summary.of(self.keys, self.outcomes, self.stored_bytes,  # type: ignore[arg-type]
                       self.is_load, self.unwritten)
        s.job_id, s.submit_time = self.job_id, self.submit_time
        if not self.is_load:
            # Only the blocks kept moved. None: bytes and time 0, which
            # vLLM's backpressure detector ignores rather than counting as a
            # store that took no time.
            moved = self.n_slots
            s.result = JobResult(
                job_id=self.job_id, success=not s.bad,
                transfer_time=self.transfer_time if moved else 0.0,
                transfer_bytes=moved * ctx.rows.row_bytes,
            )
            if ctx.emit_events and s.ok:
                s.event = OffloadingEvent(
                    keys=s.ok, medium=ctx.medium, removed=False, locality=ctx.locality,
                )
        elif s.bad:
            s.result = JobResult(
                job_id=self.job_id, success=False, successful_keys=tuple(s.ok) or None,
                transfer_time=self.transfer_time,
            )
        else:
            s.result = JobResult(job_id=self.job_id, success=True,
                                 transfer_time=self.transfer_time)
        return s

    def expire(self) -> tuple[list[bytes], list[bytes]]:
        """Scheduler thread: mark this deadlined load ``expired``; its (landed,
        not landed) keys.

        Holds the job's lock for at most one row copy. After it returns no I/O
        thread writes this job's rows again (module docstring).
        """
        assert self.lock is not None  # only loads with a deadline expire
        with self.lock:
            self.expired = True
            landed = list(self.landed)
        self.reported = True
        ok = [k for k, done in zip(self.keys, landed, strict=True) if done]
        bad = [k for k, done in zip(self.keys, landed, strict=True) if not done]
        return ok, bad

    def settle(self, ledger: Ledger) -> JobResult | None:
        """Scheduler thread: apply this finished job to ``ledger``; its JobResult,
        or None if it was reported already (failed at its deadline)."""
        if self.reported:
            return None
        self.reported = True
        try:
            s = self.summary or self.summarise()
        except Exception:  # finish broke: the slots' outcomes are unknown
            ledger.store_bytes_in_flight -= self.pinned_bytes
            return ledger.failed(self.job_id, self.is_load, self.req_id, list(self.keys),
                                 self.unwritten, self.receipt)
        if self.is_load:
            return ledger.loaded(s, self.req_id)
        return ledger.stored(s, self.receipt, self.pinned_bytes)

    def settle_expired(self, ledger: Ledger) -> JobResult:
        """Scheduler thread: report this load at its deadline (:meth:`expire`)."""
        ok, bad = self.expire()
        return ledger.expired(self.job_id, self.req_id, ok, bad, self.submit_time,
                              self.transfer_time)

    @property
    def pinned_bytes(self) -> int:
        """Bytes of the primary this store pins until it is reported (counted
        against ``max_store_bytes_in_flight``); 0 for a load."""
        return 0 if self.is_load else self.offered * self.ctx.rows.row_bytes

    def finish(self) -> None:
        self.summary = self.summarise()
        # Drop the per-slot lists here, on the I/O thread: the scheduler only
        # reads the summary, and deallocating their ~50 objects there, cold
        # in its cache, made up much of a job's completion cost. (``landed``
        # stays: an expiring load reads it under ``lock``.)
        self.outcomes, self.stored_bytes, self.cids = (), (), ()
        if self.notes:  # the load is done: its observer may use the rows it noted
            self.ctx.observer.offer(self.notes)  # type: ignore[union-attr]
        trace = self.ctx.trace
        if trace is not None and self.is_load:
            trace.published(self.job_id, self.n_slots, self.submit_time, not self.summary.bad)


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


# -- on an I/O thread ------------------------------------------------------------------
def run_slots(job: Job, codec: FrameCodec, start: int, stop: int,
              only: tuple[list[int], list[int]] | None = None) -> None:
    """Move slots ``[start, stop)`` of ``job`` through its backend; record outcomes
    (stores: ``only`` these of them, with their rows' CRC-32C, if given)."""
    try:
        if not job.is_load:
            _store(job, codec, *(only or (range(start, stop), None)))
        elif job.ctx.trace is None:
            _load(job, codec, start, stop, job.ctx.load_many)
        else:
            with job.ctx.trace.batch(job.job_id, start, stop, job.ctx.load_many) as load_many:
                _load(job, codec, start, stop, load_many)
    except Exception as exc:
        # The batch call itself failed: no slot of it can be trusted.
        err = detached(classify(exc))
        for s in range(start, stop):
            job.outcomes[s] = err


def _store(job: Job, codec: FrameCodec, slots: Sequence[int], crcs: list[int] | None) -> None:
    ctx = job.ctx
    name_of, rows = ctx.object_name, ctx.rows
    keys, cids, outcomes = job.keys, job.cids, job.outcomes
    items = [StoreItem(name_of(keys[s]), keys[s], rows[cids[s]], crc)
             for s, crc in zip(slots, crcs or repeat(None), strict=False)]
    for s, res in zip(slots, ctx.store_many(items, codec), strict=True):
        if isinstance(res, BaseException):
            outcomes[s] = detached(res)
        else:
            outcomes[s] = res > 0  # frame bytes written; 0: it existed
            job.stored_bytes[s] = res


def _load(job: Job, codec: FrameCodec, start: int, stop: int, load_many: LoadMany) -> None:
    """The one load loop: straight into the primary rows, or, for a job with
    a deadline, into this thread's bounce buffer and then into each row
    under the job's lock unless it expired (module docstring). ``load_many``:
    the backend's batch call (``ctx.load_many``, timed when traced)."""
    ctx = job.ctx
    name_of, rows = ctx.object_name, ctx.rows
    keys = job.keys[start:stop]
    deadlined = job.deadline is not None
    if deadlined:
        if job.expired or time.monotonic() > (job.deadline or 0.0):
            raise TimeoutError("load deadline passed before the transfer started")
        row = rows.row_bytes
        # Views of the scratch are not released explicitly: a codec may still
        # hold an export of them; the mmap lives as long as this thread.
        scratch = memoryview(_bounce(ctx, stop - start))
        dests = [scratch[i * row : (i + 1) * row] for i in range(stop - start)]
    else:
        dests = [rows[c] for c in job.cids[start:stop]]
    items = [LoadItem(name_of(k), k, d) for k, d in zip(keys, dests, strict=True)]
    results = load_many(items, codec)
    for s, item, res in zip(range(start, stop), items, results, strict=True):
        if isinstance(res, BaseException):
            job.outcomes[s] = detached(res)
            if isinstance(res, ObjectCorrupt):
                _remove_corrupt(ctx, item.name)
            continue
        job.stored_bytes[s] = res
        if deadlined:
            _land(job, s, item.dest)
    if ctx.observer is not None:  # the blocks now verified in their rows
        ctx.observer.loaded(job.notes, items, job.outcomes[start:stop], job.cids[start:stop])


def _land(job: Job, slot: int, scratch: memoryview) -> None:
    """Copy a verified row from the bounce buffer into its primary row, unless expired."""
    assert job.lock is not None  # a deadlined job has one from the start
    with job.lock:
        if job.expired:
            job.outcomes[slot] = TimeoutError("load finished after its deadline; discarded")
            return
        job.ctx.rows[job.cids[slot]][:] = scratch
        job.landed[slot] = True
        job.outcomes[slot] = None


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


def _remove_corrupt(ctx: TransferContext, name: str) -> None:
    """Delete a corrupt object so no later lookup finds it."""
    try:
        ctx.backend.delete(name)
    except Exception as exc:
        ctx.warn.warning(
            "corrupt-delete", "kvstore tier %s: could not remove corrupt object %s: %s",
            ctx.label, name, exc,
        )
