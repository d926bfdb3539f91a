"""The presence index: keys this process knows are stored in its tier.

Answers ``lookup`` with HIT at once, without I/O, for blocks this process
stored (the common case for a long-running engine), and lets ``submit_store``
skip blocks already stored. Bounded: past ``capacity`` keys the oldest
insertions are forgotten (a forgotten key just goes through the asynchronous
existence check again). Memory is about 100 bytes per key (a 36-byte key in
a dict), so the default million keys stay around 100 MB.

It is a ``dict`` subclass so that ``key in index`` and :meth:`update` run
in C: both are on vLLM's scheduler thread, for every key of every lookup,
store and finished job. Order is insertion order (re-adding a known key
does not refresh it): for a cache of "known to exist" this only decides
which keys are re-probed first once the cap is reached.

Scheduler-thread only; no lock.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import islice


class PresenceIndex(dict[bytes, None]):
    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity

    def add(self, key: bytes) -> None:
        self.update((key,))

    def update(self, keys: Iterable[bytes]) -> None:  # type: ignore[override]
        """Remember ``keys`` as stored, forgetting the oldest past ``capacity``."""
        if self.capacity <= 0:
            return
        super().update(dict.fromkeys(keys))
        excess = len(self) - self.capacity
        if excess > 0:
            for key in list(islice(iter(self), excess)):
                del self[key]

    def discard(self, key: bytes) -> None:
        self.pop(key, None)
