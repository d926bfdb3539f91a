"""The memory backend: frames in an LRU-ordered dict under a byte budget.

Contract (``kvstore_tiers.backends.base``) and how this module meets it:

* Called concurrently from the tier's I/O threads (``put``/``get``/
  ``touch_many``) and from vLLM's async-lookup worker (``exists_many``):
  every access to the dict holds one lock. Critical sections are dict
  operations only; the copy of the frame is made before taking the lock so
  the lock is never held across a large ``memcpy``.
* ``put`` is atomic: the object becomes visible with a single dict
  assignment of a fully built ``bytes``; a reader never sees half of it.
  Keys are content-addressed, so an existing object is left alone
  (``False``), which also keeps concurrent writers of one key harmless.
* ``get`` returns the whole object or raises ``ObjectMissing``. Returned
  ``bytes`` are immutable, so eviction can drop the dict's reference while
  a reader still decodes them.
* Capacity: ``max_bytes`` bounds the sum of stored frame sizes. A ``put``
  that does not fit evicts least-recently-used objects first; ``get`` and
  ``touch_many`` count as use. An object larger than the whole budget can
  never fit: that is a configuration problem, reported once in the log and
  as a ``TransientError`` (a failed store job), never by evicting
  everything.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

from pydantic import Field

from kvstore_tiers.backends.base import Backend, Buffer, ObjectInfo
from kvstore_tiers.backends.eviction_log import EvictionLog
from kvstore_tiers.config import TierConfig
from kvstore_tiers.errors import ObjectMissing, TransientError

logger = logging.getLogger(__name__)


class MemoryConfig(TierConfig):
    """Keys of the memory tier, on top of every common kvstore_tiers key.

    ``extra="forbid"`` is inherited: an unknown key fails engine startup
    with a message naming it and listing the accepted keys.
    """

    max_bytes: int = Field(
        256 << 20, gt=0,
        description="Byte budget for stored frames; least recently used objects are "
        "evicted to stay under it.",
    )


class MemoryBackend(Backend):
    """In-process byte store with an LRU byte budget (thread-safe)."""

    name = "memory"
    config_model = MemoryConfig
    # Local and fast: no compression by default (compression=auto -> none),
    # locality LOCAL, no default network backpressure.
    remote = False
    # Objects live in this instance, in the engine's process: a restart starts empty.
    persistent = False
    # LRU: a reuse the primary reports refreshes an object's recency.
    supports_touch = True

    def __init__(self, config: MemoryConfig, namespace: Any) -> None:
        super().__init__(config, namespace)
        self._lock = threading.Lock()
        # name -> (frame, mtime); order = recency, least recent first.
        self._objects: OrderedDict[str, tuple[bytes, float]] = OrderedDict()
        self._bytes = 0
        self._too_big_logged = False
        #: An LRU evicts: the evicted keys leave the tier's presence index.
        self.evictions: EvictionLog = EvictionLog()

    # -- lifecycle -------------------------------------------------------------
    def close(self) -> None:
        """Drop every object (the memory goes back to the process). Idempotent."""
        with self._lock:
            self._objects.clear()
            self._bytes = 0

    def describe(self) -> str:
        return f"memory (in-process, max_bytes={self.config.max_bytes})"

    @property
    def used_bytes(self) -> int:
        """Bytes of stored frames (for tests and metrics)."""
        with self._lock:
            return self._bytes

    # -- bytes -----------------------------------------------------------------
    def put(self, name: str, parts: Sequence[Buffer]) -> bool:
        # Copy outside the lock: ``parts`` may view a primary row that vLLM
        # reuses as soon as the job is reported, so we must own the bytes.
        size = sum(memoryview(p).nbytes for p in parts)
        budget = self.config.max_bytes
        if size > budget:
            if not self._too_big_logged:
                self._too_big_logged = True
                logger.warning(
                    "memory tier: a %d-byte object does not fit max_bytes=%d; "
                    "nothing is stored (raise max_bytes)", size, budget,
                )
            raise TransientError(f"object of {size} bytes exceeds max_bytes={budget}")
        with self._lock:
            if name in self._objects:
                self._objects.move_to_end(name)
                return False
        frame = b"".join(parts)
        now = time.time()
        evicted: list[str] = []
        with self._lock:
            if name in self._objects:  # a concurrent writer of the same key won
                return False
            while self._bytes + size > budget and self._objects:
                old_name, (old, _) = self._objects.popitem(last=False)
                self._bytes -= len(old)
                evicted.append(old_name)
            self._objects[name] = (frame, now)
            self._bytes += size
        if evicted:  # counted, and the keys leave the tier's presence index
            self.evictions.note_names(evicted)
        return True

    def get(self, name: str) -> bytes:
        with self._lock:
            entry = self._objects.get(name)
            if entry is None:
                raise ObjectMissing(name)
            self._objects.move_to_end(name)
        return entry[0]

    def exists_many(self, names: Sequence[str]) -> list[bool]:
        # No recency update: an existence check is not a use (the load is).
        with self._lock:
            return [n in self._objects for n in names]

    def delete(self, name: str) -> None:
        with self._lock:
            entry = self._objects.pop(name, None)
            if entry is not None:
                self._bytes -= len(entry[0])

    def iter_objects(self, prefix: str = "") -> Iterator[ObjectInfo]:
        # Snapshot under the lock, yield outside it: the caller may be slow.
        with self._lock:
            items = [(n, len(f), t) for n, (f, t) in self._objects.items() if n.startswith(prefix)]
        for n, size, mtime in items:
            yield ObjectInfo(name=n, size=size, mtime=mtime)

    def touch_many(self, names: Sequence[str]) -> None:
        with self._lock:
            for n in names:
                if n in self._objects:
                    self._objects.move_to_end(n)
