"""Read-through: blocks promoted from the tiers after a caching tier also land in it.

vLLM's manager cascades a stored block to every secondary tier and promotes a
block from the first tier that has it, but never writes a block promoted from
one tier into another. In a fleet (node-local fs, shared S3 or Redis) a node
would then read from the remote every block it did not compute itself, each
time the block falls out of its CPU tier. A tier configured with
``read_through: true`` caches the tiers of this package listed after it in
``secondary_tiers``:

1. A later tier's I/O thread, right after a batch of its load verified and
   landed (``job._load``), offers the batch to the caching tier's
   :class:`Intake`: the rows are copied while they are hot in the cache (the
   primary row may be reused once vLLM has the load), unless the copies
   waiting already hold ``read_through_max_bytes`` (then the blocks are not
   cached, and counted). The copy is the only work a load does for this.
2. The caching tier's scheduler thread, at its next ``get_finished_jobs``,
   turns each offer into a :class:`FillJob` (:func:`fill_jobs`): a store job
   of that tier over the copies, without the keys its presence index holds
   already, queued on its I/O pool like any store. So the write is the
   tier's own: its frame, codec and checksum, its admission policy, its
   capacity control, its presence index (the keys answer HIT once written)
   and its counters (``read_through_stored``). vLLM never hears of a fill.

A block is therefore written at most once per caching tier by this process
(the presence index skips the keys it holds or has in flight; a backend's
write-once put answers "existed" for one another process wrote). Tiers find
their caching tier through the ``OffloadingSpec`` they are built with
(:func:`register`, :func:`intake_for`): one spec is one manager, whose tiers
vLLM builds in list order.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore_tiers.job import Job, PrimaryRows, TransferContext

if TYPE_CHECKING:
    from kvstore_tiers.pool import IOPool
    from kvstore_tiers.presence import PresenceIndex

_intakes: weakref.WeakKeyDictionary[Any, Intake] = weakref.WeakKeyDictionary()


class Intake:
    """The caching tier's queue of copied rows (offered by other tiers' I/O threads).

    ``offer`` runs on any I/O thread of a later tier; ``offers`` is popped by
    the caching tier's scheduler thread; ``written`` is called by the caching
    tier's I/O thread that finishes a fill. The lock guards only the byte
    count and ``dropped``, among I/O threads: the scheduler thread takes no
    lock here.
    """

    def __init__(self, label: str, row_bytes: int, max_bytes: int) -> None:
        self.label = label
        self.row_bytes = row_bytes
        self.max_bytes = max_bytes
        self.offers: deque[tuple[list[bytes], np.ndarray]] = deque()
        self._lock = threading.Lock()
        self._pending = 0  # bytes of copies offered and not yet written or dropped
        #: Blocks not cached because the copies waiting held ``max_bytes`` (I/O
        #: threads), or because the pool's queue was full (scheduler thread).
        self.dropped = 0
        self.refused = 0
        self.closed = False  # the caching tier shut down: nothing more is taken

    def offer(self, keys: Sequence[bytes], rows: Sequence[memoryview]) -> None:
        """Copy ``rows`` (verified, just landed) for a fill of ``keys``; never raises
        for want of room: past ``max_bytes`` the blocks are counted in ``dropped``."""
        n = len(keys)
        if not n or self.closed:
            return
        nbytes = n * self.row_bytes
        with self._lock:
            if self._pending + nbytes > self.max_bytes:
                self.dropped += n
                return
            self._pending += nbytes
        copies = np.empty((n, self.row_bytes), np.uint8)
        for i, row in enumerate(rows):
            copies[i] = np.frombuffer(row, np.uint8)
        self.offers.append((list(keys), copies))

    @property
    def pending_bytes(self) -> int:
        """Bytes of copies offered and not yet written or dropped (0: no fill waiting
        or running; a fill is no vLLM job, so the manager's pending work omits it)."""
        return self._pending

    @property
    def not_cached(self) -> int:
        """Blocks offered and not cached for want of room."""
        return self.dropped + self.refused

    def written(self, nbytes: int) -> None:
        """A fill's copies (``nbytes``) are no longer needed."""
        with self._lock:
            self._pending -= nbytes


class FillJob(Job):
    """A store job of the caching tier whose rows are an :class:`Intake`'s copies."""

    __slots__ = ("intake", "nbytes")

    def __init__(self, ctx: TransferContext, intake: Intake, keys: list[bytes],
                 cids: list[int], copies: np.ndarray, batch: int) -> None:
        rows = PrimaryRows(memoryview(copies), intake.row_bytes)
        super().__init__(dataclasses.replace(ctx, rows=rows), -1, is_load=False, req_id="",
                         keys=keys, cids=cids, submit_time=time.monotonic(), deadline=None,
                         batch=batch)
        self.intake = intake
        self.nbytes = copies.nbytes

    def finish(self) -> None:
        super().finish()
        self.ctx.rows.release()
        self.intake.written(self.nbytes)


def fill_jobs(intake: Intake, ctx: TransferContext, presence: PresenceIndex, pool: IOPool,
              batch: int) -> None:
    """Scheduler thread of the caching tier: queue a :class:`FillJob` per offer,
    without the keys ``presence`` holds (stored, or a store in flight); blocks
    that find no room in the pool's queue are counted in ``intake.refused``."""
    offers = intake.offers
    while offers:
        keys, copies = offers.popleft()
        cids = list(range(len(keys)))
        if presence.holds_any(keys):
            keys, cids = presence.absent(keys, cids)
        if not keys:
            intake.written(copies.nbytes)
            continue
        job = FillJob(ctx, intake, keys, cids, copies, batch)
        presence.update(keys, job)
        if not pool.submit(job, is_load=False):
            presence.discard_receipt(keys, job)
            intake.written(copies.nbytes)
            intake.refused += len(keys)


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
    intake.closed = True
    if _intakes.get(spec) is intake:
        del _intakes[spec]


def intake_for(spec: Any) -> Intake | None:
    """The caching tier built before this one for ``spec``, if any."""
    return _intakes.get(spec)
