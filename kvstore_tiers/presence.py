"""The presence index: keys this process knows are stored in its tier.

Answers ``lookup`` with HIT at once, without I/O, for blocks this process
stored (the common case for a long-running engine), and lets ``submit_store``
skip blocks already stored. Bounded: past ``capacity`` keys the oldest are
forgotten (a forgotten key just goes through the asynchronous existence
check again). Memory is about 150 bytes per key (a 36-byte key in an
OrderedDict), so the default million keys stay under ~150 MB.

Scheduler-thread only; no lock.
"""

from __future__ import annotations

from collections import OrderedDict


class PresenceIndex:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: bytes) -> None:
        if self.capacity <= 0:
            return
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def discard(self, key: bytes) -> None:
        self._keys.pop(key, None)
