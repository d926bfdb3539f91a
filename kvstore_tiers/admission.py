"""Store admission: which offered blocks a tier writes.

vLLM cascades every block stored in its primary tier to every secondary
tier. Most blocks of a real workload are never read again, so a tier that
writes only the blocks likely to be read saves writes (PUTs, memory that
would evict useful blocks, bandwidth) at little or no cost in hits. The
tier's ``admission`` key picks a policy:

* ``always``: write every block (the tier then makes no admission call at all);
* ``reuse``: write a block once it has been offered ``admission_min_sightings``
  times (loads count as sightings);
* ``adaptive``: write every block while the tier has room; once it is full,
  gate by frequency, with the gate's threshold chosen by measurement
  (:class:`AdaptivePolicy`).

One job: the admission decision. Neither call runs on vLLM's scheduler
thread. :meth:`Policy.admit` decides a store job's keys once, on the I/O
thread that takes the job's first batch (``Job.start``, under the pool's
lock, before any of its blocks is written), after the presence index has
dropped the keys already stored; the job then moves only the keys
admitted, and the policy counts the others itself (:meth:`Policy.report`
puts the count into the tier's counters). :meth:`Policy.seen` counts a
load's keys, per batch, on the I/O thread that ran it. How often a key was
seen lately is the frequency sketch's (:mod:`kvstore_tiers.sketch`). The
tier composes a policy around its store path as an :class:`AdmissionLayer`
(a store filter and a load observer): jobs, pool, summaries and ledger know
nothing of admission.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvstore_tiers.config import WRITE_COST
from kvstore_tiers.job import observe_both
from kvstore_tiers.layer import TierLayer
from kvstore_tiers.sketch import FrequencySketch

if TYPE_CHECKING:
    from kvstore_tiers.job import TransferContext
    from kvstore_tiers.metrics import TierCounters
    from kvstore_tiers.ratelimit import RateLimitedLogger

logger = logging.getLogger(__name__)

class Policy(Protocol):
    """An admission policy, as the tier calls it (once per job: see the module doc)."""

    def admit(self, keys: list[bytes]) -> list[int] | None:
        """A store job offers ``keys``: None to store them all, else the indices
        of those to store (ascending; may be empty). Called from one thread at
        a time (the pool's lock); counts the sightings and the blocks it skips."""

    def report(self, counters: TierCounters) -> None:
        """Write the policy's own counts into the tier's counters (scheduler thread)."""

    def seen(self, keys: list[bytes]) -> None:
        """A load job reads ``keys``: they count as sightings (on an I/O thread)."""

    def close(self) -> None:
        """The tier shuts down (stops any thread of the policy; idempotent)."""


class AdmissionLayer(TierLayer):
    """Store admission as a layer around a tier's store path (:class:`TierLayer`).

    It puts itself into the tier's transfer context (:meth:`compose`); to
    the jobs it is then a store filter (:meth:`keep`: which of a store job's
    blocks to write, asked once by the I/O thread that starts the job) and a
    load observer (:meth:`loaded`: a load's blocks count as sightings, on the
    I/O thread that ran the batch). It counts its own skips into the tier's
    ``counters`` as it decides (:meth:`Policy.report`; these counts are
    written by no other thread). Best effort: a policy that fails, or answers
    an index out of range, admits the whole job (logged, rate-limited), and
    a sighting not counted only delays an admission.
    """

    def __init__(self, policy: Policy, counters: TierCounters, warn: RateLimitedLogger,
                 label: str) -> None:
        self.policy, self.counters, self.warn, self.label = policy, counters, warn, label

    def compose(self, ctx: TransferContext) -> TransferContext:
        """The tier's context with this layer as its store filter and one of its
        load observers."""
        return dataclasses.replace(ctx, store_filter=self,
                                   observer=observe_both(ctx.observer, self))

    def close(self) -> None:
        """Stops the policy's probe thread (it reads the backend)."""
        self.policy.close()

    def keep(self, keys: list[bytes]) -> list[int] | None:
        """The indices of ``keys`` to write (ascending), None: all of them."""
        try:
            admitted = self.policy.admit(keys)
            if admitted is not None:
                n = len(keys)
                for i in admitted:
                    if not 0 <= i < n:
                        raise IndexError(f"admitted index {i} of a job of {n} blocks")
                self.policy.report(self.counters)
            return admitted
        except Exception as exc:
            self.warn.warning("admission", "kvstore tier %s: store admission failed; "
                              "writing the job's blocks: %r", self.label, exc)
            return None

    def loaded(self, notes: list[Any], items: Sequence[Any], outcomes: Sequence[Any],
               cids: Sequence[int]) -> None:
        """A load batch ran: its blocks count as sightings (whatever became of them)."""
        try:
            self.policy.seen([item.key for item in items])
        except Exception as exc:
            self.warn.warning("sightings", "kvstore tier %s: counting a load's admission "
                              "sightings failed: %r", self.label, exc)

    def offer(self, notes: list[Any]) -> None:
        """Nothing is kept of a load once it finished."""

    def drain(self) -> None:
        """Nothing is kept of rows loaded."""


def policy_of(tier: Any) -> Policy | None:
    """The admission policy ``tier`` composed (None: ``admission: always``)."""
    return next((layer.policy for layer in tier.layers if isinstance(layer, AdmissionLayer)),
                None)


class ReusePolicy:
    """Write a block once it has been offered ``min_sightings`` times.

    Sightings are store offers of the block and loads of it, counted by a
    :class:`FrequencySketch` (with ageing, so "seen twice" means seen twice
    lately). A skipped block is counted in ``stores_not_admitted_rare``.
    """

    def __init__(self, sketch: FrequencySketch, min_sightings: int) -> None:
        self.sketch = sketch
        self.min_sightings = min_sightings
        #: Blocks offered and not admitted (written under the pool's lock).
        self.not_admitted = 0

    def admit(self, keys: list[bytes]) -> list[int] | None:
        admitted = self.sketch.offer(keys, self.min_sightings)
        if admitted is not None:
            self.not_admitted += len(keys) - len(admitted)
        return admitted

    def report(self, counters: TierCounters) -> None:
        counters.stores_not_admitted_rare = self.not_admitted

    def seen(self, keys: list[bytes]) -> None:
        self.sketch.increment(keys)

    def close(self) -> None:
        pass


#: How often the adaptive policy's probe reads the capacity and runs its miniatures.
PROBE_INTERVAL_S = 0.5

#: Bytes used, bytes allowed (None: unknown or unbounded); may do I/O.
UsageReader = Callable[[], "tuple[int, int] | None"]


class CapacitySignal:
    """Whether the tier is full, and about how many blocks it holds: adaptive's signal.

    :meth:`refresh` runs on the admission probe thread (it may do I/O: redis
    ``INFO memory``); the admitting I/O thread only reads :attr:`full`, a plain
    attribute (:attr:`blocks` is read on the probe thread, by the policy's
    update).

    The capacity is ``budget`` (the ``admission_capacity_bytes`` key) if set,
    else what the backend reports (``Backend.capacity_usage``: fs
    ``max_bytes``, redis ``maxmemory``); neither: unbounded, never full.
    Bytes used are the backend's count where it has one, else the frame
    bytes this process wrote (s3: a budget of PUT bytes). Full from
    :attr:`FULL_FRACTION` of the capacity on: an fs tier's evictor keeps it
    between its low and high watermarks (0.85-0.95) once full. Also full,
    whatever it holds now, while the backend has evicted within the last
    :attr:`EVICTION_HOLD_S` (``evictions``: its count of objects evicted
    because the store was full, ``EvictionLog.for_capacity``):
    an evictor with a wider band (a low watermark of 0.5) leaves a full
    tier well under the fraction after each round, and writing everything
    until the next round would flush it.

    :attr:`blocks` is what a full tier holds, not what its capacity would:
    the capacity times :attr:`fill`, the mean share of it held at the
    readings since the backend first evicted (an exponential average over
    :attr:`FILL_READINGS`; 1.0 until the first eviction, and where the
    backend reports no usage), at the size of one object: what the backend
    says one costs it (``object_bytes``, ``Backend.object_bytes``: redis
    counts each key's name and bookkeeping in its memory, about 1.2x a
    16 KiB frame), else the mean frame size written. An fs
    evictor keeps a full tier between its watermarks (0.85-0.95 of the
    room ``max_bytes`` leaves beside the directories, by default; 0.5-0.95
    holds 0.725 of it on average), and the miniatures of
    :class:`AdaptivePolicy` must replay the tier it is, not a larger one: a
    larger one keeps more first sightings until their reuse and chooses to
    write everything sooner.
    """

    FULL_FRACTION = 0.8
    EVICTION_HOLD_S = 60.0
    #: The fill is the mean of the first this many readings, then an exponential
    #: average with this time constant in readings (10 minutes at the probe's pace):
    #: longer than an evictor's cycle, so its swing averages out.
    FILL_READINGS = 1200

    def __init__(self, usage: UsageReader | None, budget: int | None,
                 counters: WriteCounters, row_bytes: int,
                 evictions: Callable[[], int] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 object_bytes: Callable[[], int | None] | None = None) -> None:
        self._usage = usage
        self._evictions = evictions
        self._object_bytes = object_bytes
        #: The backend's last reading of what one object costs it (0: none yet).
        self.object_size = 0
        self._clock = clock
        self._evicted = evictions() if evictions is not None else 0
        self._evicted_at: float | None = None
        self.budget = budget
        self._counters = counters
        self._row_bytes = row_bytes
        self.used = 0
        self.capacity: int | None = budget
        #: Read by the admitting I/O thread.
        self.full = False
        #: Blocks a full tier holds: the capacity times :attr:`fill`, at the
        #: size of one object (see the class doc; 0: unbounded).
        self.blocks = 0
        #: The mean share of the capacity held since the first eviction (1.0 before).
        self.fill = 1.0
        self._fill_readings = 0

    def refresh(self) -> None:
        report = None
        if self._usage is not None:
            try:
                report = self._usage()
            except Exception as exc:  # keep the last reading; the next refresh retries
                logger.debug("admission: capacity reading failed: %s", exc)
                return
        c = self._counters
        used = report[0] if report is not None else c.stored_bytes_written
        capacity = self.budget or (report[1] if report is not None else None)
        self.used, self.capacity = used, capacity
        if not capacity:
            self.full, self.blocks = False, 0
            self.fill, self._fill_readings = 1.0, 0  # a limit set later is another tier
            return
        now = self._clock()
        if self._evictions is not None and (evicted := self._evictions()) > self._evicted:
            self._evicted, self._evicted_at = evicted, now
        evicting = self._evicted_at is not None and now - self._evicted_at < self.EVICTION_HOLD_S
        self.full = evicting or used >= self.FULL_FRACTION * capacity
        # What the tier holds once its evictions have begun, at every reading
        # (the whole cycle of an evictor that refills slowly, not only the
        # hold after each round); not while it first fills, which it may do
        # slowly once the gate shuts. Only the backend's count of bytes held:
        # the bytes this process wrote only grow.
        if self._evicted_at is not None and report is not None:
            # A running mean of the first readings, then an exponential one.
            self._fill_readings = min(self._fill_readings + 1, self.FILL_READINGS)
            self.fill += (min(1.0, used / capacity) - self.fill) / self._fill_readings
        frame = c.stored_bytes_written // c.objects_stored if c.objects_stored else 0
        if report is not None:  # the backend's bytes: its own size of an object
            frame = self._read_object_size() or frame
        self.blocks = max(1, int(capacity * self.fill) // max(1, frame or self._row_bytes))

    def _read_object_size(self) -> int:
        """The backend's size of one object (``Backend.object_bytes``), or the last
        one read (0: none yet, or the backend has none)."""
        if self._object_bytes is not None:
            try:
                size = self._object_bytes()
            except Exception as exc:  # keep the last reading
                logger.debug("admission: object size reading failed: %s", exc)
            else:
                if size:
                    self.object_size = size
        return self.object_size


class WriteCounters(Protocol):
    """The tier's write counters, read by :class:`CapacitySignal`."""

    objects_stored: int
    stored_bytes_written: int


class AdaptivePolicy:
    """Write everything while the tier has room; gate by frequency once it is full.

    TinyLFU's idea -- admit a block only if it is more frequent than what it
    would displace -- with the threshold measured rather than assumed. In a
    tier that evicts least-recently-used blocks the block displaced has
    almost always been seen once (most blocks are never read again), so the
    comparison is between admitting first sightings (threshold 1: write
    everything) and admitting from the second sighting on (threshold 2).
    Which wins depends on the tier's size against the workload's reuse
    distances: a small tier evicts a first-sighted block before its reuse
    comes, so writing it only displaces blocks that were going to be read; a
    large one keeps it until the reuse and gains a hit.

    So the policy runs both, in miniature (W-TinyLFU's admission window and
    ghost entries in one mechanism): a hash sample of one sighting in
    ``256 // sample_limit`` (by the key's last hash byte, uniform) drives two
    small LRU caches of the blocks a full tier holds
    (:attr:`CapacitySignal.blocks`) scaled by the same fraction, one writing
    every block, one writing blocks whose sketch count has reached 2. Each
    counts its hits and its writes, halved every eight capacities of
    sampled sightings so that the choice follows the workload. Each scores
    its hits less ``write_cost`` per write (:data:`WRITE_COST`, 0.08 of a
    hit, by default; the admission docs say how it was chosen), and the better score chooses the
    threshold: 1 while writing everything scores higher, else 2. So writing
    everything must earn more than ``write_cost`` hits per write it adds.
    Ageing of the sketch forgets a first sighting, so a block that was not
    admitted is tried again later instead of being shut out for good.

    Hits and writes of the miniatures, not a ratio of their hits: a hot block
    that happens to be in the sample (a system prompt's, in nearly every
    request) is a hit in both miniatures and a write in neither. It leaves
    the difference of their hits and of their writes as they were, where it
    would pull the ratio of their hits towards 1.

    :meth:`admit` and :meth:`seen` (I/O threads) are one C call each,
    which counts the sightings and appends the sampled keys, each with its
    count as of its sighting, to a list.
    Everything else -- reading the capacity, running the miniatures, choosing
    the threshold -- runs in :meth:`update`, on the probe thread
    (:class:`AdmissionProbe`), which publishes the threshold as a plain
    attribute. A skipped block is counted in ``stores_not_admitted_cold``.
    """

    def __init__(self, sketch: FrequencySketch, signal: CapacitySignal,
                 sample_limit: int = 16, write_cost: float = WRITE_COST) -> None:
        self.sketch = sketch
        self.signal = signal
        self.sample_limit = sample_limit
        self.write_cost = write_cost
        #: The gate's threshold once the tier is full (read by the I/O threads).
        self.threshold = 2
        #: Sampled sightings, flat: [key, count, key, count, ...], for update().
        self._samples: list[bytes | int] = []
        self._write_all: OrderedDict[bytes, None] = OrderedDict()
        self._gated: OrderedDict[bytes, None] = OrderedDict()
        self.hits_write_all = 0.0
        self.hits_gated = 0.0
        self.writes_write_all = 0.0
        self.writes_gated = 0.0
        self._refs = 0
        self._probe: AdmissionProbe | None = None
        #: Blocks offered and not admitted (written under the pool's lock).
        self.not_admitted = 0

    # -- I/O threads -------------------------------------------------------------------
    def admit(self, keys: list[bytes]) -> list[int] | None:
        admitted = self.sketch.offer(keys, self.threshold if self.signal.full else 1,
                                     self.sample_limit, self._samples)
        if admitted is not None:
            self.not_admitted += len(keys) - len(admitted)
        return admitted

    def report(self, counters: TierCounters) -> None:
        counters.stores_not_admitted_cold = self.not_admitted

    def seen(self, keys: list[bytes]) -> None:
        self.sketch.increment(keys, self.sample_limit, self._samples)

    # -- probe thread ------------------------------------------------------------------
    def update(self) -> None:
        """Run the sampled sightings through the miniatures; choose the threshold."""
        cap = max(1, self.signal.blocks * self.sample_limit // 256)
        # Take the list, leave a new one. Another thread may still append to
        # the old one if it read the attribute just before: the loop's
        # range is fixed at its start, so those few sightings go unsampled.
        flat, self._samples = self._samples, []
        for i in range(0, len(flat) - 1, 2):
            self._sighting(flat[i], flat[i + 1], cap)  # type: ignore[arg-type]
        gain = self.hits_write_all - self.hits_gated
        added = self.writes_write_all - self.writes_gated
        self.threshold = 1 if gain > self.write_cost * added else 2

    def _sighting(self, key: bytes, count: int, cap: int) -> None:
        """One sampled sighting (``count``: the sketch's, with it) through both miniatures."""
        write_all, gated = self._write_all, self._gated
        if key in write_all:
            write_all.move_to_end(key)
            self.hits_write_all += 1
        else:
            write_all[key] = None
            self.writes_write_all += 1
        if key in gated:
            gated.move_to_end(key)
            self.hits_gated += 1
        elif count >= 2:
            gated[key] = None
            self.writes_gated += 1
        for mini in (write_all, gated):
            while len(mini) > cap:
                mini.popitem(last=False)
        self._refs += 1
        if self._refs >= 8 * cap:
            self._refs = 0
            self.hits_write_all /= 2
            self.hits_gated /= 2
            self.writes_write_all /= 2
            self.writes_gated /= 2

    def start(self, interval_s: float) -> None:
        """Refresh the capacity signal and :meth:`update` every ``interval_s``, in a thread."""
        self._probe = AdmissionProbe(self, interval_s)
        self._probe.start()

    def close(self) -> None:
        if self._probe is not None:
            self._probe.stop()
            self._probe = None


class AdmissionProbe:
    """The adaptive policy's own thread: capacity readings and the miniatures.

    Holds the policy weakly, so a tier dropped without ``shutdown`` does not
    keep its thread alive.
    """

    def __init__(self, policy: AdaptivePolicy, interval_s: float) -> None:
        self._policy = weakref.ref(policy)
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstore_admission", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            policy = self._policy()
            if policy is None:
                return
            try:
                policy.signal.refresh()
                policy.update()
            except Exception:
                logger.exception("admission: probe failed; the threshold is left as it was")
            del policy
            if self._stop.wait(self._interval_s):
                return
