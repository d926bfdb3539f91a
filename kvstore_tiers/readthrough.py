"""Read-through: blocks promoted from the tiers after a caching tier also land in it.

vLLM's manager cascades a stored block to every secondary tier and promotes a
block from the first tier that has it, but never writes a block promoted from
one tier into another. In a fleet (node-local fs, shared S3 or Redis) a node
would then read from the remote every block it did not compute itself, each
time the block falls out of its CPU tier. A tier configured with
``read_through: true`` caches the tiers of this package listed after it in
``secondary_tiers``:

1. A later tier's I/O thread, right after a batch of a load verified and
   landed (``job._load``), copies its rows while they are hot in the CPU cache
   (:meth:`Intake.copy`: the primary row may be reused once vLLM has the
   load), unless the copies waiting already hold ``read_through_max_bytes``
   (then the blocks are not cached, and counted). The copy is the only work a
   load does for this. The thread that finishes the load job hands its copies
   to the caching tier (:meth:`Intake.offer`), so no write of them starts
   before the whole load is done.
2. That thread also builds the :class:`FillJob`: a store job of the caching
   tier over the copies. The caching tier's scheduler thread queues it on
   its I/O pool like any store (:func:`fill_jobs`), one poll after it was
   offered (by then vLLM has been told of the load, so the write does not
   compete with the load's last step), without the keys its presence index
   holds already. So the write is the tier's own: its frame, codec and
   checksum, its admission policy, its capacity control, its presence index
   (the keys answer HIT once written) and its counters
   (``read_through_stored``). vLLM never hears of a fill.

A block is therefore written at most once per caching tier by this process
(the presence index skips the keys it holds or has in flight; a backend's
write-once put answers "existed" for one another process wrote). Tiers find
their caching tier through the ``OffloadingSpec`` they are built with
(:func:`register`, :func:`intake_for`): one spec is one manager, whose tiers
vLLM builds in list order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore_tiers.batching import LoadItem, Result
from kvstore_tiers.job import Job, PrimaryRows, TransferContext
from kvstore_tiers.metrics import TierCounters

if TYPE_CHECKING:
    from kvstore_tiers.pool import IOPool
    from kvstore_tiers.presence import PresenceIndex

_intakes: weakref.WeakKeyDictionary[Any, Intake] = weakref.WeakKeyDictionary()


#: One load batch's copies: (keys, one row buffer each).
Part = tuple[list[bytes], list[np.ndarray]]


class Intake:
    """The caching tier's queue of rows copied from other tiers' loads.

    :meth:`copy` and :meth:`offer` run on I/O threads of later tiers;
    ``offers`` (fill jobs ready to queue) is emptied by the caching tier's
    scheduler thread, which alone reads and writes ``ripe``;
    :meth:`written` is called by the caching tier's I/O thread that finishes a
    fill. The lock guards the byte count, the kept buffers and the caching
    tier's ``read_through_dropped`` counter (the scheduler thread takes it only
    to count a fill its pool refused).
    """

    def __init__(self, label: str, row_bytes: int, max_bytes: int) -> None:
        self.label = label
        self.row_bytes = row_bytes
        self.max_bytes = max_bytes
        self.offers: deque[FillJob] = deque()
        self.ripe = 0  # offers already there at the last poll
        self._ctx: TransferContext | None = None  # the caching tier's (bind)
        self._batch = 1
        self._lock = threading.Lock()
        self._pending = 0  # bytes of copies made and not yet written or dropped
        # Row buffers of copies no longer needed, reused by later copies: a
        # fresh buffer's pages are faulted in and zeroed by the kernel during
        # the copy, which would slow the load it is made from. In use plus
        # kept never exceed max_bytes (a buffer is made only when none is kept).
        self._free: list[np.ndarray] = []
        #: Where blocks not cached for want of room are counted (bind).
        self._counters = TierCounters()
        self.closed = False  # the caching tier shut down: nothing more is taken

    def bind(self, ctx: TransferContext, batch: int, counters: TierCounters) -> None:
        """The caching tier's transfer context and store batch, for its fills, and
        its counters."""
        self._ctx, self._batch, self._counters = ctx, batch, counters

    @property
    def pending_bytes(self) -> int:
        """Bytes of copies offered and not yet written or dropped (0: no fill waiting
        or running; a fill is no vLLM job, so the manager's pending work omits it)."""
        return self._pending

    def copy(self, keys: list[bytes], rows: Sequence[memoryview]) -> Part | None:
        """Copies of ``rows`` (verified, just landed) for a fill of ``keys``; None
        past ``max_bytes`` (the blocks are counted in ``read_through_dropped``) or
        once closed."""
        n = len(keys)
        nbytes = n * self.row_bytes
        with self._lock:
            if self.closed:
                return None
            if self._pending + nbytes > self.max_bytes:
                self._counters.read_through_dropped += n
                return None
            self._pending += nbytes
            free = self._free
            bufs = free[len(free) - min(n, len(free)):]
            del free[len(free) - len(bufs):]
        bufs += [np.empty(self.row_bytes, np.uint8) for _ in range(n - len(bufs))]
        for buf, row in zip(bufs, rows, strict=True):
            np.copyto(buf, np.frombuffer(row, np.uint8))
        return keys, bufs

    def copy_loaded(self, parts: list[Part], items: Sequence[LoadItem],
                    results: Sequence[Result]) -> None:
        """A load batch landed (I/O thread): append to ``parts`` the copies of
        its verified rows. Best effort, never raises: a block not cached is
        only read again from the tier that has it."""
        ok = [item for item, res in zip(items, results, strict=True)
              if not isinstance(res, BaseException)]
        if ok:
            with contextlib.suppress(Exception):
                part = self.copy([item.key for item in ok], [item.dest for item in ok])
                if part is not None:
                    parts.append(part)

    def offer(self, parts: list[Part]) -> None:
        """A load job finished (its last I/O thread): a fill job of its copies."""
        bufs = [b for p in parts for b in p[1]]
        if self.closed or self._ctx is None:
            self.written(bufs)
            return
        keys = [k for p in parts for k in p[0]]
        self.offers.append(FillJob(self._ctx, self, keys, bufs, self._batch))

    def written(self, bufs: list[np.ndarray]) -> None:
        """The copies ``bufs`` are no longer needed: kept for reuse."""
        with self._lock:
            self._pending -= len(bufs) * self.row_bytes
            if not self.closed:
                self._free += bufs

    def refused(self, n: int) -> None:
        """The caching tier's pool refused a fill of ``n`` blocks (scheduler thread)."""
        with self._lock:
            self._counters.read_through_dropped += n

    def close(self) -> None:
        """Nothing more is taken; the kept buffers are freed."""
        with self._lock:
            self.closed = True
            self._free = []


class Copies(PrimaryRows):
    """A fill's rows: views of the copies, in place of vLLM's primary rows."""

    __slots__ = ("views",)

    def __init__(self, views: list[memoryview], row_bytes: int) -> None:
        self.views, self.count, self.row_bytes, self._flat = views, len(views), row_bytes, None

    def __getitem__(self, chunk_id: int) -> memoryview:
        return self.views[chunk_id]

    def release(self) -> None:
        self.views = []


class FillJob(Job):
    """A store job of the caching tier whose rows are copies of other tiers' loads."""

    __slots__ = ("bufs", "intake")

    def __init__(self, ctx: TransferContext, intake: Intake, keys: list[bytes],
                 bufs: list[np.ndarray], batch: int) -> None:
        rows = Copies([memoryview(b) for b in bufs], intake.row_bytes)
        super().__init__(dataclasses.replace(ctx, rows=rows), -1, is_load=False, req_id="",
                         keys=keys, cids=list(range(len(keys))), submit_time=time.monotonic(),
                         deadline=None, batch=batch)
        self.intake = intake
        self.bufs = bufs  # all of them, also those keep() leaves out: returned at the end

    def keep(self, keys: list[bytes]) -> None:
        """Before it is queued: write only ``keys`` (the others are held already)."""
        rows = self.ctx.rows
        assert isinstance(rows, Copies)
        slot = {k: i for i, k in enumerate(self.keys)}
        rows.views = [rows.views[slot[k]] for k in keys]
        self.keys, self.cids = keys, list(range(len(keys)))
        self.narrow(len(keys))

    def finish(self) -> None:
        super().finish()
        self.ctx.rows.release()
        self.intake.written(self.bufs)


def fill_jobs(intake: Intake, presence: PresenceIndex, pool: IOPool) -> None:
    """Scheduler thread of the caching tier: queue the fill jobs that were
    already offered at the last poll, without the keys ``presence`` holds
    (stored, or a store in flight); blocks that find no room in the pool's
    queue are counted in ``read_through_dropped``."""
    offers = intake.offers
    for _ in range(min(intake.ripe, len(offers))):
        job = offers.popleft()
        keys = job.keys
        if presence.holds_any(keys):
            keys = [k for k in keys if k not in presence]
            if not keys:
                intake.written(job.bufs)
                continue
            job.keep(keys)
        presence.update(keys, job)
        if not pool.submit(job, is_load=False):
            presence.discard_receipt(keys, job)
            intake.written(job.bufs)
            intake.refused(len(keys))
    intake.ripe = len(offers)


def register(spec: Any, intake: Intake) -> None:
    """``intake`` caches the tiers built after it for ``spec`` (one manager)."""
    from kvstore_tiers.errors import ConfigError

    if spec in _intakes:
        raise ConfigError(f"read_through: tier {intake.label!r} sets it, and so does tier "
                          f"{_intakes[spec].label!r} listed before it; one tier of "
                          "secondary_tiers may cache the tiers after it")
    _intakes[spec] = intake


def unregister(spec: Any, intake: Intake) -> None:
    """The caching tier shuts down: later loads are no longer offered to it."""
    intake.close()
    if _intakes.get(spec) is intake:
        del _intakes[spec]


def intake_for(spec: Any) -> Intake | None:
    """The caching tier built before this one for ``spec``, if any."""
    return _intakes.get(spec)
