"""Store admission: which offered blocks a tier writes.

vLLM cascades every block stored in its primary tier to every secondary
tier. Most blocks of a real workload are never read again, so a tier that
writes only the blocks likely to be read saves writes (PUTs, memory that
would evict useful blocks, bandwidth) at little or no cost in hits. The
tier's ``admission`` key picks a policy:

* ``always``: write every block (the tier then makes no admission call at all);
* ``reuse``: write a block once it has been offered ``admission_min_sightings``
  times (loads count as sightings);
* ``adaptive``: :class:`AdaptivePolicy`.

One job: the admission decision. The tier calls :meth:`Policy.admit` once
per store job and :meth:`Policy.seen` once per load job, on vLLM's scheduler
thread, after the presence index has dropped the keys already stored; keys
not admitted are simply not stored. The per-key work (four counter updates)
runs in C (``_sketch.c``) when it is compiled, in the Python twins below
otherwise; a test checks both agree.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Protocol

#: Rows of the sketch (independent counters per key; the estimate is their minimum).
ROWS = 4
#: Counters saturate here (4 bits' worth; ageing halves them).
MAX_COUNT = 15
#: translate() table that halves every counter: the whole ageing pass in C.
_HALVE = bytes(i >> 1 for i in range(256))


def _mix32(g: int) -> int:
    """murmur3's 32-bit finaliser: every bit of the group index reaches the low bits."""
    g ^= g >> 16
    g = (g * 0x85EBCA6B) & 0xFFFFFFFF
    g ^= g >> 13
    g = (g * 0xC2B2AE35) & 0xFFFFFFFF
    return g ^ (g >> 16)


def _row_slots(key: bytes, mask: int, width: int) -> list[int]:
    """The table offsets of ``key``'s counters (the C kernel's ``bump``)."""
    if not isinstance(key, bytes):
        raise TypeError("sketch keys must be bytes")
    if len(key) < 4 * ROWS:
        raise ValueError("sketch keys must be at least 16 bytes")
    group = _mix32(int.from_bytes(key[32:36], "little"))
    return [r * width + ((int.from_bytes(key[4 * r:4 * r + 4], "little") ^ group) & mask)
            for r in range(ROWS)]


def _bump_py(table: bytearray, mask: int, key: bytes) -> int:
    slots = _row_slots(key, mask, mask + 1)
    m = min(table[s] for s in slots)
    if m >= MAX_COUNT:
        return MAX_COUNT
    for s in slots:
        if table[s] == m:
            table[s] = m + 1
    return m + 1


def _offer_py(table: bytearray, keys: list[bytes], mask: int, threshold: int
              ) -> list[int] | None:
    """Python twin of ``_sketch.offer``: count a sighting of every key; None if
    every estimate reached ``threshold``, else the indices of those that did."""
    estimates = [_bump_py(table, mask, k) for k in keys]
    if all(e >= threshold for e in estimates):
        return None
    return [i for i, e in enumerate(estimates) if e >= threshold]


def _increment_py(table: bytearray, keys: list[bytes], mask: int) -> None:
    """Python twin of ``_sketch.increment``: count a sighting of every key."""
    for k in keys:
        _bump_py(table, mask, k)


_offer: Callable[[bytearray, list[bytes], int, int], list[int] | None] = _offer_py
_increment: Callable[[bytearray, list[bytes], int], None] = _increment_py
if os.environ.get("KVSTORE_TIERS_NATIVE_SKETCH", "1") != "0":
    try:  # not compiled here: the Python twins
        from kvstore_tiers._sketch import increment as _increment  # type: ignore[no-redef]
        from kvstore_tiers._sketch import offer as _offer  # type: ignore[no-redef]
    except ImportError:
        pass
NATIVE = _offer is not _offer_py


class FrequencySketch:
    """A count-min sketch with ageing: how often each key was seen, lately.

    ``ROWS`` (4) rows of ``width`` one-byte counters (a power of two, so
    ``4 * width`` bytes in all: 256 KiB at the default 2^16), conservative
    update, counters saturating at 15. A key's estimate is the minimum of its
    four counters: never below the true count since the last ageing
    (collisions only add), capped at 15. Every ``sample`` increments (default
    ``width``) every counter is halved, so old popularity fades, a key seen
    once is forgotten within one to two periods, and the memory stays what it
    was at start, whatever the number of keys. With at most ``width`` distinct
    keys between two halvings, a key never seen reads as seen with
    probability at most (1 - 1/e)^4 (16 %), and far less when keys repeat.

    Keys are vLLM's offload keys (a uniform 32-byte block hash, then a
    4-byte group index): row ``r`` indexes by hash bytes ``[4r, 4r+4)``
    mixed with the group; no hashing is needed.

    Scheduler thread only; no lock.
    """

    def __init__(self, width: int, sample: int | None = None, native: bool = True) -> None:
        if width < 16 or width & (width - 1):
            raise ValueError("sketch width must be a power of two >= 16")
        self.width = width
        self.mask = width - 1
        self.table = bytearray(ROWS * width)
        self.sample = sample if sample is not None else width
        self.additions = 0
        self.agings = 0
        self._offer = _offer if native else _offer_py
        self._increment = _increment if native else _increment_py

    @property
    def nbytes(self) -> int:
        """Memory of the counters (bytes); fixed at start."""
        return len(self.table)

    def offer(self, keys: list[bytes], threshold: int) -> list[int] | None:
        """Count one sighting of each of ``keys``; None if every key has now been
        seen at least ``threshold`` times, else the indices of those that have."""
        admitted = self._offer(self.table, keys, self.mask, threshold)
        self._added(len(keys))
        return admitted

    def increment(self, keys: list[bytes]) -> None:
        """Count one sighting of each of ``keys``."""
        self._increment(self.table, keys, self.mask)
        self._added(len(keys))

    def estimate(self, key: bytes) -> int:
        """How often ``key`` was seen (at least; at most 15), ageing applied."""
        table = self.table
        return min(table[s] for s in _row_slots(key, self.mask, self.width))

    def _added(self, n: int) -> None:
        self.additions += n
        if self.additions >= self.sample:
            self.table[:] = self.table.translate(_HALVE)
            self.additions //= 2
            self.agings += 1


class SkipCounters(Protocol):
    """Where a policy counts the stores it did not admit (the tier's counters)."""

    stores_not_admitted_rare: int
    stores_not_admitted_cold: int


class Policy(Protocol):
    """An admission policy, as the tier calls it (scheduler thread, once per job)."""

    def admit(self, keys: list[bytes]) -> list[int] | None:
        """A store job offers ``keys``: None to store them all, else the indices
        of those to store (ascending; may be empty). Counts the others."""

    def seen(self, keys: list[bytes]) -> None:
        """A load job reads ``keys``: they count as sightings."""


class ReusePolicy:
    """Write a block once it has been offered ``min_sightings`` times.

    Sightings are store offers of the block and loads of it, counted by a
    :class:`FrequencySketch` (with ageing, so "seen twice" means seen twice
    lately). A skipped block is counted in ``stores_not_admitted_rare``.
    """

    def __init__(self, sketch: FrequencySketch, min_sightings: int,
                 counters: SkipCounters) -> None:
        self.sketch = sketch
        self.min_sightings = min_sightings
        self.counters = counters

    def admit(self, keys: list[bytes]) -> list[int] | None:
        admitted = self.sketch.offer(keys, self.min_sightings)
        if admitted is not None:
            self.counters.stores_not_admitted_rare += len(keys) - len(admitted)
        return admitted

    def seen(self, keys: list[bytes]) -> None:
        self.sketch.increment(keys)


def select(keys: list[bytes], cids: list[int], admitted: Sequence[int]
           ) -> tuple[list[bytes], list[int]]:
    """The admitted keys and their chunk ids, in order."""
    return [keys[i] for i in admitted], [cids[i] for i in admitted]
