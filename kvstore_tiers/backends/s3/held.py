"""Object bodies an existence check fetched, held for the load that follows.

A fresh engine's lookup of a stored prefix costs, with HEADs, two requests per
block (HEAD, then GET) and two round trips; an existence check that GETs the
object instead answers the lookup once the status is in, and its body, still
arriving, is the one the load asks for next. :class:`HeldBodies` keeps those
bodies (or the reads still filling them) between the two: bounded in bytes
(``lookup_prefetch_bytes``), each for at most ``hold_s``, taken (and so no
longer held) by the first load of its key. A body that does not fit is not
read: it only costs that load its own GET.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class HeldBodies(Generic[T]):
    """Bodies (of any type ``T``: the backend holds the tasks reading them) by
    object key, at most ``max_bytes`` in all, each for ``hold_s``.

    Thread-safe. Room is reserved from a body's Content-Length before it is
    read (:meth:`reserve`), so the bytes held or being read never pass
    ``max_bytes``. ``on_drop`` gets each body that expires unread or is
    replaced (any thread: it must be safe to call from one).
    """

    def __init__(self, max_bytes: int, hold_s: float,
                 on_drop: Callable[[T], object] = lambda _: None) -> None:
        self.max_bytes = max_bytes
        self.hold_s = hold_s
        self._on_drop = on_drop
        self._held: dict[str, tuple[T, int, float]] = {}  # insertion order = expiry order
        self._bytes = 0  # held plus reserved
        #: Largest body reserved so far: below that much room, fetching one is a gamble.
        self.largest = 0
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def nbytes(self) -> int:
        """Bytes held or reserved now."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._held)

    def _expire(self, now: float) -> list[T]:
        dropped = []
        for key, (body, size, until) in list(self._held.items()):
            if until > now:
                break
            del self._held[key]
            self._bytes -= size
            dropped.append(body)
        return dropped

    def _drop(self, bodies: list[T]) -> None:
        for body in bodies:  # outside the lock
            self._on_drop(body)

    def sweep(self) -> None:
        """Drop every body past its ``hold_s`` (the backend calls it once each has
        had its time, so nothing outlives it when no later lookup comes)."""
        with self._lock:
            dropped = self._expire(time.monotonic())
        self._drop(dropped)

    def room_for(self, n: int) -> int:
        """How many of ``n`` bodies as large as the largest seen would fit now (all
        ``n`` while none has been seen; 0 when disabled)."""
        with self._lock:
            dropped = self._expire(time.monotonic())
            fit = (0 if not self.enabled else n if not self.largest
                   else max(0, min(n, (self.max_bytes - self._bytes) // self.largest)))
        self._drop(dropped)
        return fit

    def reserve(self, nbytes: int) -> bool:
        """Room for a body of ``nbytes``, counted until :meth:`hold` or :meth:`release`;
        False: it does not fit (read nothing)."""
        with self._lock:
            dropped = self._expire(time.monotonic())
            ok = self.enabled and self._bytes + nbytes <= self.max_bytes
            if ok:
                self._bytes += nbytes
                self.largest = max(self.largest, nbytes)
        self._drop(dropped)
        return ok

    def release(self, nbytes: int) -> None:
        """A reservation of ``nbytes`` whose body is not held."""
        with self._lock:
            self._bytes -= nbytes

    def hold(self, key: str, body: T, reserved: int) -> None:
        """Hold ``body`` (``reserved`` bytes, reserved already) under ``key`` for ``hold_s``."""
        with self._lock:
            old = self._held.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._held[key] = (body, reserved, time.monotonic() + self.hold_s)
        if old is not None:
            self._on_drop(old[0])

    def take(self, key: str) -> T | None:
        """The body held under ``key``, no longer held (nor counted); None if none or
        expired."""
        with self._lock:
            entry = self._held.pop(key, None)
            if entry is None:
                return None
            body, size, until = entry
            self._bytes -= size
        if until > time.monotonic():
            return body
        self._on_drop(body)
        return None
