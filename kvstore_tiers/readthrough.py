"""Read-through: blocks promoted from the tiers after a caching tier also land in it.

vLLM's manager cascades a stored block to every secondary tier and promotes a
block from the first tier that has it, but never writes a block promoted from
one tier into another. In a fleet (node-local fs, shared S3 or Redis) a node
would then read from the remote every block it did not compute itself, each
time the block falls out of its CPU tier. A tier configured with
``read_through: true`` caches the tiers of this package listed after it in
``secondary_tiers``:

1. A later tier's I/O thread, right after a batch of a load verified and
   landed (``job._load``), notes each block's key, primary row and
   :func:`mark`: the row's CRC-32C as the frame checks answered it (an
   encrypted frame has none, so it is computed there) and 128 bytes spread
   over the row (:meth:`Intake.loaded`), unless the
   blocks waiting already come to ``read_through_max_bytes`` (then they are
   not cached, and counted). That note is all a load does for this: no copy.
   The thread that finishes the load job hands its notes to the caching tier
   (:meth:`Intake.offer`), so no write of them starts before the whole load
   is done.
2. That thread also builds the :class:`FillJob`: a store of the caching
   tier over those rows. The caching tier's scheduler thread queues it on
   its I/O pool like any store (:meth:`ReadThrough.step`), one poll after it
   was offered (by then vLLM has been told of the load, so the write does
   not compete with the load's last step), without the keys its presence
   index holds already. The fill is composed from the store path, not a
   kind of it: it runs a plain store :class:`~kvstore_tiers.job.Job` of the
   tier over rows of its own (:class:`Snapshots`). So the write is the
   tier's own: its frame, codec and checksum, its store filter, its capacity
   control, its presence index (the keys answer HIT once written) and its
   counters (``read_through_stored``). vLLM never hears of a fill.
3. vLLM owns the primary rows: once it has the load it may reuse a row for
   another block at any time. So the fill's I/O thread first copies each
   row into a buffer of its own (a snapshot no one else writes) and writes
   the block only if the snapshot's mark equals the one its load noted: a
   row reused meanwhile would have to match both the verified CRC-32C and
   the bytes sampled to pass. A block that fails is not cached (counted in
   ``read_through_dropped``). The frame takes the verified CRC. A drain
   (``reset_cache``, sleep) of the caching tier or of a tier it caches drops
   the blocks loaded before it, whose rows vLLM frees.

A block is therefore written at most once per caching tier by this process
(the presence index skips the keys it holds or has in flight; a backend's
write-once put answers "existed" for one another process wrote).

The caching tier holds all of this as one layer (:class:`ReadThrough`, a
:class:`~kvstore_tiers.layer.TierLayer`) and names none of it. At its
first step the layer subscribes the intake to the tiers after it
(:func:`subscribe`), from the list of tiers vLLM's manager built
(:func:`kvstore_tiers.compat.secondary_tiers`): vLLM builds the tiers one
by one and calls none of them before the manager exists. No lookup by the
spec: a tier builds with any spec object.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import mmap
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter, ValidationError

from kvstore_tiers.batching import LoadItem
from kvstore_tiers.config import TierConfig
from kvstore_tiers.errors import ConfigError
from kvstore_tiers.frame import FrameCodec, checksum
from kvstore_tiers.job import Job, TransferContext, run_slots
from kvstore_tiers.layer import TierLayer
from kvstore_tiers.metrics import TierCounters
from kvstore_tiers.outcome import NOT_WRITTEN
from kvstore_tiers.pool import PoolJob

if TYPE_CHECKING:
    from kvstore_tiers.ledger import Ledger
    from kvstore_tiers.pool import IOPool
    from kvstore_tiers.presence import PresenceIndex

#: What a fill compares a row with: its CRC-32C and bytes sampled over it (:func:`mark`).
Mark = tuple[int, bytes]
#: One load batch's blocks to cache: (keys, their primary rows, their rows' marks).
Part = tuple[list[bytes], list[int], list[Mark]]
_SAMPLED = 128  # bytes of a row in its mark


def mark(row: memoryview, crc: int | None = None) -> Mark:
    """``row``'s mark: its CRC-32C (``crc`` when the frame checks just verified
    it) and :data:`_SAMPLED` bytes spread evenly over it."""
    return (checksum(row) if crc is None else crc), bytes(row[:: max(1, len(row) // _SAMPLED)])


class Intake:
    """The caching tier's queue of blocks that other tiers' loads put in primary rows.

    :meth:`loaded` and :meth:`offer` run on I/O threads of later tiers;
    ``offers`` (fill jobs ready to queue) is emptied by the caching tier's
    scheduler thread, which alone reads and writes ``ripe``; the caching
    tier's I/O threads take and give back snapshot buffers and call
    :meth:`settled` when a fill finishes. The lock guards the byte count, the
    kept buffers and the caching tier's ``read_through_dropped`` counter.
    """

    def __init__(self, label: str, row_bytes: int, max_bytes: int, batch: int,
                 counters: TierCounters) -> None:
        self.label = label
        self.row_bytes = row_bytes
        self.max_bytes = max_bytes
        self.offers: deque[FillJob] = deque()
        self.ripe = 0  # offers already there at the last poll
        self._ctx: TransferContext | None = None  # the caching tier's (bind)
        self._batch = batch  # the caching tier's store batch
        self._lock = threading.Lock()
        self._pending = 0  # bytes of blocks offered and not yet written or dropped
        # Snapshot buffers of fills, kept for the next: a fresh buffer's pages
        # are faulted in and zeroed by the kernel on first use. Page-aligned
        # (anonymous mmap), so the fs tier writes them with O_DIRECT as it
        # writes primary rows; at most one per row a fill thread holds at once.
        self._free: list[mmap.mmap] = []
        #: The caching tier's, where blocks not cached are counted.
        self._counters = counters
        self.closed = False  # the caching tier shut down: nothing more is taken
        #: Bumped by :meth:`drain`; a fill offered before it is dropped.
        self.generation = 0

    def bind(self, ctx: TransferContext) -> None:
        """The caching tier's transfer context, for its fills (its last, with
        every layer's hooks: a fill passes the tier's store filter)."""
        self._ctx = ctx

    @property
    def pending_bytes(self) -> int:
        """Bytes of blocks offered and not yet written or dropped (0: no fill waiting
        or running; a fill is no vLLM job, so the manager's pending work omits it)."""
        return self._pending

    def take(self, keys: list[bytes], cids: list[int], marks: list[Mark]) -> Part | None:
        """A part of ``keys`` (in primary rows ``cids``, with ``marks``) to
        cache; None past ``max_bytes`` (the blocks are counted in
        ``read_through_dropped``) or once closed."""
        n = len(keys)
        with self._lock:
            if self.closed:
                return None
            if self._pending + n * self.row_bytes > self.max_bytes:
                self._counters.read_through_dropped += n
                return None
            self._pending += n * self.row_bytes
        return keys, cids, marks

    def loaded(self, parts: list[Part], items: Sequence[LoadItem], outcomes: Sequence[Any],
               cids: Sequence[int]) -> None:
        """A load batch landed (I/O thread): append to ``parts`` its blocks that
        are in their primary rows (``outcomes`` None). Best effort, never
        raises: a block not cached is only read again from the tier that has it."""
        ok = [i for i, res in enumerate(outcomes) if res is None]
        if ok:
            with contextlib.suppress(Exception):
                marks = [mark(items[i].dest, items[i].crc) for i in ok]
                part = self.take([items[i].key for i in ok], [cids[i] for i in ok], marks)
                if part is not None:
                    parts.append(part)

    def offer(self, parts: list[Part]) -> None:
        """A load job finished (its last I/O thread): a fill job of its blocks."""
        keys = [k for p in parts for k in p[0]]
        if self.closed or self._ctx is None:
            with self._lock:
                self._pending -= len(keys) * self.row_bytes
            return
        cids = [c for p in parts for c in p[1]]
        marks = [m for p in parts for m in p[2]]
        self.offers.append(FillJob(self._ctx, self, keys, cids, marks, self._batch,
                                   self.generation, len(keys)))

    def settled(self, job: FillJob, dropped: int) -> None:
        """``job`` is written, or will not be: its blocks leave the pending bytes,
        and ``dropped`` of them were not cached (a reused row, a drain, a full
        pool queue: counted in ``read_through_dropped``)."""
        with self._lock:
            self._pending -= job.offered * self.row_bytes
            self._counters.read_through_dropped += dropped

    def drain(self) -> None:
        """A tier of the manager drained (scheduler thread, after its running
        jobs finished): vLLM may free the rows of what was loaded before, so
        :func:`fill_jobs` drops the fills offered so far."""
        self.generation += 1

    def buffers(self, n: int) -> list[mmap.mmap]:
        """``n`` snapshot buffers of a row each (kept ones first)."""
        with self._lock:
            free = self._free
            bufs = free[len(free) - min(n, len(free)):]
            del free[len(free) - len(bufs):]
        return bufs + [mmap.mmap(-1, self.row_bytes) for _ in range(n - len(bufs))]

    def give_back(self, bufs: list[mmap.mmap]) -> None:
        """Snapshot buffers no longer used: kept for the next fill."""
        with self._lock:
            if not self.closed:
                self._free += bufs

    def close(self) -> None:
        """Nothing more is taken; the kept buffers are dropped."""
        with self._lock:
            self.closed = True
            self._free = []


class Snapshots:
    """A fill's rows (:class:`~kvstore_tiers.job.Rows`): its snapshots, by
    position in the fill (None: not taken, or given back)."""

    __slots__ = ("row_bytes", "views")

    def __init__(self, n: int, row_bytes: int) -> None:
        self.views: list[memoryview | None] = [None] * n
        self.row_bytes = row_bytes

    def __getitem__(self, chunk_id: int) -> memoryview:
        view = self.views[chunk_id]
        assert view is not None
        return view

    def release(self) -> None:
        self.views = []


class FillJob(PoolJob):
    """A write of the caching tier that vLLM never submitted: blocks other
    tiers' loads put in primary rows.

    Composed from the store path: :attr:`store` is a plain store
    :class:`~kvstore_tiers.job.Job` of the caching tier over
    :class:`Snapshots`, slot ``s`` the block at position ``store.cids[s]`` of
    the fill (primary row ``rows_of[pos]``, noted with ``marks[pos]``).
    The pool runs this job; each hook hands the store job what it would be
    given as a job of its own (it narrows itself to what the tier's store
    filter keeps, and this job follows it), and :meth:`run` first takes a
    snapshot of each row and checks its mark: a slot whose row was reused is
    not run, its outcome :data:`~kvstore_tiers.outcome.NOT_WRITTEN`. Neither
    job's fields are rewritten after it was built.
    """

    __slots__ = ("ctx", "generation", "intake", "keys", "marks", "offered", "reused",
                 "rows_of", "store")

    def __init__(self, ctx: TransferContext, intake: Intake, keys: list[bytes],
                 rows_of: list[int], marks: list[Mark], batch: int, generation: int,
                 offered: int) -> None:
        n = len(keys)
        PoolJob.__init__(self, -1, n, batch)
        self.store = Job(dataclasses.replace(ctx, rows=Snapshots(n, intake.row_bytes)), -1,
                         is_load=False, req_id="", keys=keys, cids=list(range(n)),
                         submit_time=time.monotonic(), deadline=None, batch=batch)
        self.ctx, self.intake, self.keys = ctx, intake, keys
        self.rows_of, self.marks = rows_of, marks
        #: The intake's generation when the blocks were offered, and how many were
        #: (a fill of some of them, :meth:`only`, still answers for them all).
        self.generation, self.offered = generation, offered
        self.reused: list[int] = []  # slots whose row no longer held the block loaded

    @property
    def receipt(self) -> object:
        """The presence index's receipt of the store job's keys."""
        return self.store.receipt

    def only(self, keys: list[bytes]) -> FillJob:
        """Before it is queued: a fill of ``keys`` alone (the others are held
        already), answering for the blocks this one was offered."""
        pos = {k: i for i, k in enumerate(self.keys)}
        at = [pos[k] for k in keys]
        return FillJob(self.ctx, self.intake, keys, [self.rows_of[i] for i in at],
                       [self.marks[i] for i in at], self.batch, self.generation, self.offered)

    def start(self, runs: bool) -> None:
        store = self.store
        store.start(runs)  # the tier's store filter may narrow it
        if store.n_slots != self.n_slots:
            self.narrow(store.n_slots)

    def run(self, codec: FrameCodec, start: int, stop: int) -> None:
        if start == stop:
            return
        store = self.store
        snaps = store.ctx.rows
        assert isinstance(snaps, Snapshots)
        bufs = self.intake.buffers(stop - start)
        taken, crcs, reused = [], [], []
        try:
            for s, buf in zip(range(start, stop), bufs, strict=True):
                pos = store.cids[s]
                view = memoryview(buf)
                view[:] = self.ctx.rows[self.rows_of[pos]]
                if mark(view) == self.marks[pos]:
                    snaps.views[pos] = view
                    taken.append(s)
                    crcs.append(self.marks[pos][0])
                else:
                    reused.append(s)
            run_slots(store, codec, start, stop, (taken, crcs))
            for s in reused:  # after the batch: a failed call marks every slot failed
                store.outcomes[s] = NOT_WRITTEN
        finally:
            self.reused += reused
            for s in range(start, stop):
                snaps.views[store.cids[s]] = None
            self.intake.give_back(bufs)

    def cancel(self, start: int, stop: int) -> None:
        self.store.cancel(start, stop)

    def finish(self) -> None:
        store = self.store
        store.finish()  # blocks not written leave the presence index once settled
        store.ctx.rows.release()
        self.intake.settled(self, len(self.reused))

    def settle(self, ledger: Ledger) -> None:
        """A store of this tier that vLLM never submitted: applied, counted in
        ``read_through_stored``, and reported to no one. It pins no primary row
        of its own (it writes snapshots)."""
        store = self.store
        s = store.summary or store.summarise()
        ledger.stored(s, store.receipt, 0)
        ledger.counters.read_through_stored += s.written


def fill_jobs(intake: Intake, presence: PresenceIndex, pool: IOPool) -> None:
    """Scheduler thread of the caching tier: queue the fill jobs that were
    already offered at the last poll, without the keys ``presence`` holds
    (stored, or a store in flight); blocks that find no room in the pool's
    queue are counted in ``read_through_dropped``."""
    offers = intake.offers
    for _ in range(min(intake.ripe, len(offers))):
        job = offers.popleft()
        keys = job.keys
        if job.generation != intake.generation:  # loaded before a drain
            intake.settled(job, len(keys))
            continue
        if presence.holds_any(keys):
            keys = [k for k in keys if k not in presence]
            if not keys:
                intake.settled(job, 0)
                continue
            job = job.only(keys)
        presence.update(keys, job.receipt)
        if not pool.submit(job, is_load=False):
            presence.discard_receipt(keys, job.receipt)
            intake.settled(job, len(keys))
    intake.ripe = len(offers)


_ON = TypeAdapter(TierConfig.model_fields["read_through"].annotation)


def check_one_caching_tier(configs: list[Any], label: str) -> None:
    """Start-up: ``read_through`` is on in at most one of a manager's tier
    ``configs`` (``secondary_tiers`` in order), each value read as the tier's
    own config reads it (``"false"`` is off); else a ConfigError naming the key."""
    caching = []
    for config in configs:
        if not isinstance(config, dict) or "read_through" not in config:
            continue
        try:
            on = _ON.validate_python(config["read_through"])
        except ValidationError:
            raise ConfigError(f"invalid config for secondary tier {config.get('type')!r}: key "
                              "'read_through': not a boolean") from None
        if on:
            caching.append(config.get("type"))
    if len(caching) > 1:
        raise ConfigError(f"read_through: tier {label!r} sets it, and so do the tiers "
                          f"{caching!r} of the same secondary_tiers; one tier may cache the "
                          "tiers after it")


def subscribe(intake: Intake, tiers: list[Any], caching: Any) -> None:
    """Wire the caching tier ``caching`` (its ``intake``) to the tiers listed
    after it in ``tiers`` (vLLM's, in ``secondary_tiers`` order): each reports
    the blocks its loads verify to ``intake`` (``observe_loads``). Tiers that
    are not ours (no ``observe_loads``) are left alone. A list without
    ``caching`` (a vLLM whose manager keeps its tiers elsewhere) caches nothing,
    and says so once, rather than leaving read-through off without a word."""
    if not any(tier is caching for tier in tiers):
        logging.getLogger(__name__).warning(
            "read_through: the tiers vLLM built were not found (this vLLM keeps them "
            "elsewhere); this tier caches nothing of the tiers after it")
        return
    after = False
    for tier in tiers:
        if after and hasattr(tier, "observe_loads"):
            tier.observe_loads(intake)
        after = after or tier is caching


class ReadThrough(TierLayer):
    """Read-through as a layer of the caching tier (:class:`~kvstore_tiers.layer.TierLayer`):
    its :class:`Intake`, subscribed to the tiers after it at the first step,
    and the fills it queues on the tier's pool at each poll."""

    def __init__(self, intake: Intake, presence: PresenceIndex, pool: IOPool) -> None:
        self.intake, self.presence, self.pool = intake, presence, pool

    def compose(self, ctx: TransferContext) -> TransferContext:
        self.intake.bind(ctx)  # the fills' context; a load of this tier is not observed
        return ctx

    def wire(self, tier: Any, tiers: Sequence[Any] | None) -> None:
        subscribe(self.intake, list(tiers or ()), tier)

    def step(self) -> None:
        if self.intake.offers:  # blocks later tiers loaded
            fill_jobs(self.intake, self.presence, self.pool)

    @property
    def pending_bytes(self) -> int:
        return self.intake.pending_bytes

    def drain(self) -> None:
        self.intake.drain()

    def close(self) -> None:
        self.intake.close()  # later tiers' loads are no longer offered to it


def intake_of(tier: Any) -> Intake | None:
    """The intake of ``tier``'s read-through layer (None: it caches no tier)."""
    return next((layer.intake for layer in tier.layers if isinstance(layer, ReadThrough)), None)
