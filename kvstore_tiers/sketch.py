"""The frequency sketch of store admission: how often each key was seen lately.

A count-min sketch of 4-bit counters (four per key, in one 64-byte block of
the table) with periodic ageing that halves every counter, as Caffeine's
TinyLFU does. The per-key work (four counter updates) runs in C
(``_sketch.c``) when it is compiled, in the Python twins below otherwise
(``KVSTORE_TIERS_NATIVE_SKETCH=0`` forces them); a test checks both agree.
The policies (:mod:`kvstore_tiers.admission`) ask it one question per job.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

#: Counters per key (one per quarter of its 64-byte block; the estimate is their minimum).
ROWS = 4
#: The shortest OffloadKey: a 16-byte block hash (xxhash) and a 4-byte group index.
MIN_KEY = 20
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


def _row_slots(key: bytes, width: int) -> list[int]:
    """The table offsets of ``key``'s four counters (the C kernel's ``locate``):
    one 64-byte block chosen by hash bytes [0, 4), one counter in each of its
    16-byte quarters chosen by four bits of bytes [4, 8); both mixed with the
    group index (the key's last 4 bytes: vLLM's OffloadKey is the block hash,
    32 bytes with sha256 or 16 with xxhash, then the group index)."""
    if not isinstance(key, bytes):
        raise TypeError("sketch keys must be bytes")
    if len(key) < MIN_KEY:
        raise ValueError("sketch keys must be at least 20 bytes "
                         "(a 16-byte block hash and a 4-byte group index)")
    group = _mix32(int.from_bytes(key[-4:], "little"))
    block = 64 * ((int.from_bytes(key[0:4], "little") ^ group) & (width // 16 - 1))
    bits = int.from_bytes(key[4:8], "little") ^ group
    return [block + 16 * r + ((bits >> (4 * r)) & 15) for r in range(ROWS)]


def _bump_py(table: bytearray, mask: int, key: bytes) -> int:
    slots = _row_slots(key, mask + 1)
    m = min(table[s] for s in slots)
    if m >= MAX_COUNT:
        return MAX_COUNT
    for s in slots:
        if table[s] == m:
            table[s] = m + 1
    return m + 1


#: Items a samples list may hold (two per sampled sighting; ``SAMPLES_MAX`` in
#: the C kernel): past it, sightings are not sampled until the list is taken.
SAMPLES_MAX = 1 << 20


def _sample_py(key: bytes, count: int, limit: int, samples: list[bytes | int] | None) -> None:
    """Append ``key`` and ``count`` to ``samples`` if the key is in the hash sample
    (its last hash byte, the one before the group index, below ``limit``: a
    sample of ``limit`` in 256) and the list has room."""
    if samples is not None and len(samples) < SAMPLES_MAX and key[-5] < limit:
        samples += (key, count)


def _offer_py(table: bytearray, keys: list[bytes], mask: int, threshold: int,
              limit: int = 0, samples: list[bytes | int] | None = None) -> list[int] | None:
    """Python twin of ``_sketch.offer``: count a sighting of every key; None if
    every estimate reached ``threshold``, else the indices of those that did.
    With ``samples``, also sample the sightings (:func:`_sample_py`)."""
    estimates = []
    for k in keys:
        estimates.append(e := _bump_py(table, mask, k))
        _sample_py(k, e, limit, samples)
    if all(e >= threshold for e in estimates):
        return None
    return [i for i, e in enumerate(estimates) if e >= threshold]


def _increment_py(table: bytearray, keys: list[bytes], mask: int, limit: int = 0,
                  samples: list[bytes | int] | None = None) -> None:
    """Python twin of ``_sketch.increment``: count (and sample) a sighting of every key."""
    for k in keys:
        _sample_py(k, _bump_py(table, mask, k), limit, samples)


def _estimate_py(table: bytearray, key: bytes, mask: int) -> int:
    """Python twin of ``_sketch.estimate``: the minimum of ``key``'s counters."""
    return min(table[s] for s in _row_slots(key, mask + 1))


_offer: Callable[..., list[int] | None] = _offer_py
_increment: Callable[..., None] = _increment_py
_estimate: Callable[[bytearray, bytes, int], int] = _estimate_py
if os.environ.get("KVSTORE_TIERS_NATIVE_SKETCH", "1") != "0":
    try:  # not compiled here: the Python twins
        from kvstore_tiers._sketch import (  # type: ignore[no-redef]
            estimate as _estimate,
        )
        from kvstore_tiers._sketch import increment as _increment  # type: ignore[no-redef]
        from kvstore_tiers._sketch import offer as _offer  # type: ignore[no-redef]
    except ImportError:
        pass
NATIVE = _offer is not _offer_py


class FrequencySketch:
    """A count-min sketch with ageing: how often each key was seen, lately.

    ``4 * width`` one-byte counters (``width`` a power of two: 1 MiB at the
    tier's default 2^18), as blocks of 64, one cache line each. A key has
    four counters in one block, one per 16-byte quarter (a blocked count-min,
    as Caffeine's: one cache miss per key, not four). Conservative update,
    counters saturating at 15. A key's estimate is the minimum of its four
    counters: never below the true count since the last ageing
    (collisions only add), capped at 15. Every ``period`` increments (default
    ``width``) every counter is halved, so old popularity fades, a key seen
    once is forgotten within one to two periods, and the memory stays what it
    was at start, whatever the number of keys. With at most ``width`` distinct
    keys between two halvings, a key never seen reads as seen with
    probability at most (1 - 1/e)^4 (16 %), and far less when keys repeat.

    Keys are vLLM's offload keys (a uniform block hash of 32 bytes, or 16
    with xxhash, then a 4-byte group index): the block and the counters are
    slices of the hash mixed with the group (:func:`_row_slots`); no hashing
    is needed.

    I/O threads count: the one that starts a store job offers its keys
    (:meth:`offer`), the one that runs a load counts its keys
    (:meth:`increment`). With the C kernels each count is one call under
    the GIL, so no counter is torn. Ageing is under a lock and checks the
    period again, so two threads crossing it at once halve the table once.
    The count of additions is updated outside that lock: where ``+=`` can
    be interrupted (CPython before 3.11), a rare interleaving loses a few
    additions or ages the table once more, and a halving may overwrite a
    count made during it; each only shifts an estimate by a sighting or
    delays an admission.
    The adaptive policy's probe thread reads only the samples.
    """

    def __init__(self, width: int, period: int | None = None, native: bool = True) -> None:
        if width < 16 or width & (width - 1):  # at least one block
            raise ValueError("sketch width must be a power of two >= 16")
        self.width = width
        self.mask = width - 1
        self.table = bytearray(ROWS * width)
        self.period = period if period is not None else width
        self.additions = 0
        self.agings = 0
        self._age_lock = threading.Lock()
        self._offer = _offer if native else _offer_py
        self._increment = _increment if native else _increment_py
        self._estimate = _estimate if native else _estimate_py

    @property
    def nbytes(self) -> int:
        """Memory of the counters (bytes); fixed at start."""
        return len(self.table)

    def offer(self, keys: list[bytes], threshold: int, limit: int = 0,
              samples: list[bytes | int] | None = None) -> list[int] | None:
        """Count one sighting of each of ``keys``; None if every key has now been
        seen at least ``threshold`` times, else the indices of those that have.

        With ``samples``: each key in the hash sample (its last hash byte, the
        one before the group index, below ``limit``: ``limit`` in 256 keys) is
        appended to it with its count after this sighting, while the list
        holds fewer than :data:`SAMPLES_MAX` items. In the same C call: the
        adaptive policy's miniatures cost the admitting thread no call of
        their own.
        """
        admitted = self._offer(self.table, keys, self.mask, threshold, limit, samples)
        self._added(len(keys))
        return admitted

    def increment(self, keys: list[bytes], limit: int = 0,
                  samples: list[bytes | int] | None = None) -> None:
        """Count one sighting of each of ``keys`` (and sample them, as :meth:`offer`)."""
        self._increment(self.table, keys, self.mask, limit, samples)
        self._added(len(keys))

    def estimate(self, key: bytes) -> int:
        """How often ``key`` was seen (at least; at most 15), ageing applied."""
        return self._estimate(self.table, key, self.mask)

    def _added(self, n: int) -> None:
        self.additions += n
        if self.additions >= self.period:
            self._age()

    def _age(self) -> None:
        with self._age_lock:
            if self.additions < self.period:  # another thread has just aged it
                return
            self.table[:] = self.table.translate(_HALVE)
            self.additions //= 2
            self.agings += 1
