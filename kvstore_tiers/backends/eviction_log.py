"""The eviction capability: what a backend's store removed on its own.

A backend whose store evicts (fs ``max_bytes``/``min_free_bytes``, redis
``maxmemory`` or ``ttl_s`` heard through keyspace events, a plugin's own
cap) sets :attr:`Backend.evictions <kvstore_tiers.backends.base.Backend.evictions>`
to an :class:`EvictionLog` and reports there from its own threads. The tier
drains the keys into its presence index (so it stops answering HIT for a
block that is gone) and shows the counts in its metrics; ``admission:
adaptive`` reads a tier that evicted for capacity lately as full.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Sequence

from kvstore_tiers.naming import key_from_object_name

#: Evicted keys held for the tier to take; past it the oldest are dropped
#: (those keys' next loads fail and are recomputed, as for an object another
#: process removed).
EVICTED_KEYS_MAX = 1 << 16


class EvictionLog:
    """Counts and keys of objects a store removed. Safe from several threads."""

    __slots__ = ("_lock", "for_capacity", "keys", "objects")

    def __init__(self) -> None:
        #: Objects removed for capacity, or evicted or expired by the server.
        self.objects = 0
        #: Of those, the ones removed because the store was full (not expired).
        self.for_capacity = 0
        #: Their block keys, oldest first, for the tier to take (bounded).
        self.keys: deque[bytes] = deque(maxlen=EVICTED_KEYS_MAX)
        self._lock = threading.Lock()  # one reporting thread per cluster primary

    def note(self, objects: int, keys: Iterable[bytes], for_capacity: bool = True) -> None:
        """``objects`` objects were removed (``for_capacity`` False: they expired);
        ``keys`` are the block keys among them."""
        with self._lock:
            self.objects += objects
            if for_capacity:
                self.for_capacity += objects
        self.keys.extend(keys)

    def note_names(self, names: Sequence[str]) -> None:
        """:meth:`note` for objects removed for capacity, given by their names
        (or paths ending in one): the keys are read back from the names."""
        self.note(len(names), [k for k in map(key_from_object_name, names) if k is not None])
