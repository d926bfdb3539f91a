"""The presence index: keys this process knows are stored in its tier, or is storing.

Answers ``lookup`` with HIT at once, without I/O, for blocks this process
stored (the common case for a long-running engine), and lets ``submit_store``
skip blocks already stored *or in flight*. Bounded: past ``capacity`` keys
the oldest insertions are forgotten (a forgotten key just goes through the
asynchronous existence check again, and a forgotten in-flight key can at
worst be written twice, which the atomic publish makes harmless). Memory is
about 120 bytes per key (~50 for the dict and the FIFO, ~69 for the 36-byte
key object; tests/faults/test_scale.py), so the default million keys stay
around 120 MB.

A key's value says what is known of it:

* ``None``: stored (a store this process completed long ago, or an object
  the backend's existence check found);
* a :class:`StoreReceipt` (``Job.receipt``): written by one store job of
  this process, and stored once that job's completion has been reported
  (:func:`settle`).

Why receipts: a store job puts its keys here once, at submit, all pointing
at one receipt; when it completes, settling the receipt makes all of
them stored at once. Completing a job therefore costs the scheduler thread
nothing per key (the keys' hash slots, cold in cache by then, are only
touched again for a failed key or one its job did not write),
where a set of in-flight keys plus an insert per stored key cost it ~35 us
per 16-key job here.

Keys enter the FIFO at submit, while they are warm in cache, also those a
store filter will not write: such a key leaves the dict when its job
completes and its FIFO entry waits for its turn, so a tier that skips a
share of what it is offered remembers about that share fewer stored keys
than ``capacity``. Adding keys to the FIFO at completion instead (only the
written ones) touched every key object there, cold by then, or kept a
container per job that the cyclic GC must walk: either cost every tier
(one that filters nothing too) more in ``get_finished_jobs`` than the
dilution costs a filtering one (measured at 26dbc0f; the A/B is in git's
history of docs/benchmarks.md).

It is a ``dict`` subclass so that ``key in index``, :meth:`update` and
:meth:`stored` run mostly in C: they are on vLLM's scheduler thread. The
oldest insertions are forgotten first, through a FIFO of inserted keys
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

#: Shared by the keys of one store job: empty while the job is in flight,
#: one byte once its completion is reported (:func:`settle`), so that
#: :meth:`PresenceIndex.stored` tells the two apart by truth value, as
#: cheaply as reading a slot. Its own object rather than the job, which
#: holds keys and outcomes the index has no use for; a bytearray because the
#: cyclic GC does not track one, so making it on vLLM's scheduler thread
#: does not bring the next GC pass closer (tests/backends/fs/test_fs_tier.py
#: counts what a submit adds).
StoreReceipt = bytearray


def new_receipt() -> StoreReceipt:
    """A receipt for a store job about to be submitted (in flight)."""
    return bytearray()


def settle(receipt: StoreReceipt) -> None:
    """The receipt's job completed: its keys are stored (idempotent)."""
    receipt[:] = b"\x01"


class PresenceIndex(dict[bytes, StoreReceipt | None]):
    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self._fifo: deque[bytes] = deque()  # insertion order, for forgetting the oldest

    def stored(self, key: bytes) -> bool:
        """True if ``key`` is known to be stored (not merely in flight)."""
        value = self.get(key, b"")  # not held: falsy, as an unsettled receipt
        # Branches, not ``return value is None or bool(value)``: on every
        # lookup, one builtin call less (measured as fast as reading a slot).
        if value is None or value:  # noqa: SIM103 - found, or a settled receipt
            return True
        return False

    def add(self, key: bytes) -> None:
        """Remember ``key`` as stored."""
        self.update((key,))

    def update(  # type: ignore[override]
        self, keys: Iterable[bytes], receipt: StoreReceipt | None = None
    ) -> None:
        """Remember ``keys`` as stored, or as written by the job of ``receipt``,
        forgetting the oldest past ``capacity``."""
        if self.capacity <= 0:
            return
        # A plain loop: on the scheduler thread every temporary container
        # (a batch dict, its iterator, a super() proxy) counts towards the
        # next cyclic-GC pass while it lives; this allocates one iterator.
        fifo = self._fifo
        for key in keys:
            self[key] = receipt
            fifo.append(key)
        if len(fifo) > self.capacity:
            self._trim()

    def holds_any(self, keys: Iterable[bytes]) -> bool:
        """True if any of ``keys`` is in the index (stored or in flight)."""
        # A loop, not any(<generator>) or keys().isdisjoint(): those
        # allocate a generator or a view besides the iterator.
        for key in keys:  # noqa: SIM110
            if key in self:
                return True
        return False

    def absent(self, keys: Sequence[bytes], rows: Sequence[int]
               ) -> tuple[list[bytes], list[int]]:
        """The keys not in the index (neither stored nor in flight), with their rows."""
        todo = [i for i, k in enumerate(keys) if k not in self]
        return [keys[i] for i in todo], [rows[i] for i in todo]

    def discard(self, key: bytes) -> None:
        self.pop(key, None)

    def forget(self, key: bytes) -> bool | None:
        """Drop ``key``; whether it was stored (True), in flight (False) or
        not held at all (None)."""
        value = self.pop(key, self)
        if value is self:
            return None
        return value is None or len(value) > 0

    def discard_receipt(self, keys: Iterable[bytes], receipt: StoreReceipt) -> None:
        """Forget those of ``keys`` that still point at ``receipt`` (their store
        failed, or their job did not write them)."""
        for key in keys:
            if self.get(key) is receipt:
                del self[key]

    def _trim(self) -> None:
        # The FIFO holds every insertion, including keys since discarded or
        # inserted again; bounding it bounds the memory of both.
        fifo, pop = self._fifo, self.pop
        while len(fifo) > self.capacity:
            pop(fifo.popleft(), None)
