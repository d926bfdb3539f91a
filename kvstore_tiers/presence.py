"""The presence index: keys this process knows are stored in its tier, or is storing.

Answers ``lookup`` with HIT at once, without I/O, for blocks this process
stored (the common case for a long-running engine), and lets ``submit_store``
skip blocks already stored *or in flight*. Bounded: past ``capacity``
stored keys the oldest are forgotten (a forgotten key just goes through
the asynchronous existence check again, and one forgotten while a store
of it is in flight again can at worst be written twice, which the atomic
publish makes harmless). Memory is about 120 bytes per key (~50 for the
dict and the FIFO, ~69 for the 36-byte key object;
tests/faults/test_scale.py), so the default million keys stay around
120 MB, plus the keys in flight beside the bound (see below).

A key's value says what is known of it:

* ``None``: stored (a store this process completed long ago, or an object
  the backend's existence check found);
* a :class:`StoreReceipt` (in the tier, the store job itself): written by
  one store job of this process, and stored once that job's completion has
  been reported (``receipt.done``).

Why receipts: a store job puts its keys here once, at submit, all pointing
at one receipt (:meth:`pend`); when it completes, flipping ``receipt.done``
makes all of them stored at once. Completing a job therefore costs the
scheduler thread nothing per key in Python (the keys' hash slots, cold in
cache by then, are only touched again for a failed key or one the
admission policy did not write), where a set of in-flight keys plus an
insert per stored key cost it ~35 us per 16-key job here.

Only stored keys count against ``capacity``: a pending key enters the
FIFO when its store completes (:meth:`settle`), so keys that were never
written (not admitted, failed) take no place in it. The FIFO holds a
completed job's key list as one entry: a reference per key would touch
every key object, cold in cache by then, at completion
(docs/benchmarks.md, *Store admission: scheduler-thread cost*).
Pending keys are bounded by the tier's store backlog
(``max_store_bytes_in_flight`` and the I/O queue).

It is a ``dict`` subclass so that ``key in index``, :meth:`pend` and
:meth:`stored` run mostly in C: they are on vLLM's scheduler thread. The
oldest insertions are forgotten first, through a FIFO of inserted batches
beside the dict: trimming by iterating the dict from its start, as this
index first did, rescans every entry deleted since the dict's last resize,
so at capacity a 16-key update cost ~200 us instead of ~10 (a million keys,
measured here). A key inserted twice is in the FIFO twice and may be
forgotten at its first turn: for a cache of "known to exist" that only
means one more existence check.

What remains at capacity is CPython's own dict compaction: after about as
many insertions as the capacity, one update rebuilds the table (~80 ms for a
million keys here), as any dict of that size in vLLM's scheduler does.

Scheduler-thread only; no lock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import Protocol


class StoreReceipt(Protocol):
    """Shared by the keys of one store job; ``done`` once its completion is reported.

    The tier uses the store job itself as its receipt: one object less to
    allocate on vLLM's scheduler thread per submit.
    """

    done: bool


class PresenceIndex(dict[bytes, StoreReceipt | None]):
    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        #: Batches of keys (or single keys) in the order they were remembered, for
        #: forgetting the oldest.
        self._fifo: deque[Sequence[bytes] | bytes] = deque()
        self._held = 0  # keys in the FIFO's batches

    def stored(self, key: bytes) -> bool:
        """True if ``key`` is known to be stored (not merely in flight)."""
        value = self.get(key, self)  # ``self``: a sentinel no value can be
        return value is None or (value is not self and value.done)  # type: ignore[union-attr]

    def add(self, key: bytes) -> None:
        """Remember ``key`` as stored (in the FIFO as itself, not a batch of one:
        a tuple per key would double the index's memory per key)."""
        if self.capacity <= 0:
            return
        self[key] = None
        self._fifo.append(key)
        self._held += 1
        if self._held > self.capacity:
            self._trim()

    def update(self, keys: Iterable[bytes]) -> None:  # type: ignore[override]
        """Remember ``keys`` as stored, forgetting the oldest past ``capacity``."""
        if self.capacity <= 0:
            return
        batch = keys if isinstance(keys, (list, tuple)) else list(keys)
        # A plain loop: on the scheduler thread every temporary container
        # (a batch dict, its iterator, a super() proxy) counts towards the
        # next cyclic-GC pass while it lives; this allocates one iterator.
        for key in batch:
            self[key] = None
        self._remember(batch)

    def pend(self, keys: Iterable[bytes], receipt: StoreReceipt) -> None:
        """Remember ``keys`` as being written by the job of ``receipt``
        (in flight: not yet counted against ``capacity``)."""
        if self.capacity <= 0:
            return
        for key in keys:
            self[key] = receipt

    def settle(self, keys: Sequence[bytes]) -> None:
        """``keys`` of a completed store job are stored (its receipt says so):
        from now on they count against ``capacity``, the oldest forgotten past it.

        The sequence itself is kept, not copied (one reference, whatever its
        length): nobody may change it afterwards. The tier passes the job's
        key list, vLLM's own, which vLLM drops once the job is reported."""
        if self.capacity > 0 and keys:
            self._remember(keys)

    def _remember(self, batch: Sequence[bytes]) -> None:
        self._fifo.append(batch)
        self._held += len(batch)
        if self._held > self.capacity:
            self._trim()

    def holds_any(self, keys: Iterable[bytes]) -> bool:
        """True if any of ``keys`` is in the index (stored or in flight)."""
        # A loop, not any(<generator>) or keys().isdisjoint(): those
        # allocate a generator or a view besides the iterator.
        for key in keys:  # noqa: SIM110
            if key in self:
                return True
        return False

    def discard(self, key: bytes) -> None:
        self.pop(key, None)

    def discard_receipt(self, keys: Iterable[bytes], receipt: StoreReceipt) -> None:
        """Forget those of ``keys`` that still point at ``receipt`` (their store
        failed, or the admission policy did not write them)."""
        for key in keys:
            if self.get(key) is receipt:
                del self[key]

    def _trim(self) -> None:
        # The FIFO holds every insertion, including keys since discarded or
        # inserted again; bounding it bounds the memory of both. Whole
        # batches go: at most one batch more than the capacity asks.
        fifo, pop = self._fifo, self.pop
        while self._held > self.capacity:
            batch = fifo.popleft()
            if isinstance(batch, bytes):  # one key (add)
                self._held -= 1
                pop(batch, None)
                continue
            self._held -= len(batch)
            for key in batch:
                pop(key, None)
