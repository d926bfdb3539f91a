"""Keys an existence check found absent, remembered for a while.

A prefix that misses in every tier is looked up again at every step while
its request waits; each lookup of an s3 tier would be a HEAD request. The
cache answers "absent" for ``negative_cache_s`` instead; a store of the key
forgets it at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence


class NegativeCache:
    """Object keys recently found absent, each remembered for ``ttl_s``.

    Thread-safe (the lookup worker checks and fills it, the event-loop thread
    forgets keys it stores). Bounded: past ``max_keys`` entries it starts
    over, which only costs re-probing.
    """

    def __init__(self, ttl_s: float, max_keys: int = 200_000) -> None:
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._until: dict[str, float] = {}
        self._lock = threading.Lock()

    def check(self, keys: Sequence[str]) -> list[bool]:
        if self.ttl_s <= 0:
            return [False] * len(keys)
        now = time.monotonic()
        with self._lock:
            return [self._until.get(k, 0.0) > now for k in keys]

    def remember(self, key: str) -> None:
        if self.ttl_s <= 0:
            return
        with self._lock:
            if len(self._until) >= self.max_keys:
                self._until.clear()
            self._until[key] = time.monotonic() + self.ttl_s

    def forget(self, key: str) -> None:
        with self._lock:
            self._until.pop(key, None)
