"""Memory for GET bodies, carved from large mappings the kernel backs with huge pages.

A fresh engine's first load of a stored prefix holds up to ``lookup_prefetch_bytes``
of bodies at once, in memory the process has never touched. Allocated body by body
by the HTTP client, every 4 KiB page of it faults once, on the backend's one
event-loop thread, delaying every request behind it
(docs/benchmarks.md#where-a-fresh-engines-first-s3-load-went-page-faults-of-its-event-loop).
Bodies carved from an anonymous mapping advised ``MADV_HUGEPAGE`` fault once per
2 MiB instead.

:class:`BodyArena` carves bodies one after another from a mapping of
``chunk_bytes`` (two huge pages by default); when one is used up, the next is
taken. Nothing is freed explicitly: each body is a memoryview that keeps its
mapping alive, so a body can be handed to the core and dropped like ``bytes``.
When the last body carved from a mapping is gone, the mapping goes back to the
arena, which keeps up to ``keep_bytes`` of them (64 MiB by default: 16
mappings, 48 frames of 1 MiB blocks) for the next loads, their pages already
faulted in; past that it is unmapped. Never ``release()`` a body: a tensor or
array made from it may not hold the buffer, and its mapping would be reused. A body
larger than half a chunk gets a mapping of its own, never kept. Small chunks
bound what one body kept long (a held body whose load never comes, for up to
the hold time) keeps resident: its chunk, not a large arena.

So the kernel's zeroing of fresh pages (and, where free huge pages are short,
its compaction to find them) is paid for the mappings a process first needs,
not on every load; the price is up to ``keep_bytes`` resident while no load
runs.

Only worth it where transparent huge pages are on for advised mappings
(:func:`huge_pages_available`): without them a fresh mapping faults page by page
on every load, where the allocator would have reused the memory of the last.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
import weakref
from collections import deque
from pathlib import Path

import numpy as np

#: The size of a huge page on x86-64 and arm64 with 4 KiB base pages.
HUGE_PAGE = 2 << 20
#: Where Linux says whether transparent huge pages back advised mappings.
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
#: Emptied mappings an arena keeps for later bodies, in bytes (see the module docstring).
KEEP_BYTES = 64 << 20


def huge_pages_available(path: Path = THP_ENABLED) -> bool:
    """True when the kernel backs ``MADV_HUGEPAGE`` mappings with transparent huge
    pages (its setting is ``[always]`` or ``[madvise]``, not ``[never]``) and Python
    can advise one."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        setting = path.read_text()
    except OSError:
        return False
    return "[always]" in setting or "[madvise]" in setting


def _mapping(nbytes: int) -> mmap.mmap:
    """A fresh anonymous mapping of ``nbytes``, advised to use huge pages."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # Refused (a kernel without THP): plain pages, still correct.
    with contextlib.suppress(OSError):
        m.madvise(mmap.MADV_HUGEPAGE)
    return m


def _give_back(free: deque[mmap.mmap], keep: int, m: mmap.mmap) -> None:
    """The last body of ``m`` is gone: keep it for later bodies while fewer than
    ``keep`` wait, else let it be unmapped.

    Runs on whichever thread dropped that body, or inside the garbage collector
    (a body in a reference cycle), possibly while that thread is in
    :meth:`BodyArena.take`: so it takes no lock; a deque's append is atomic, and
    threads racing here keep at most one mapping more each than ``keep``."""
    if len(free) < keep:
        free.append(m)


class BodyArena:
    """Writable buffers for bodies, from mappings of ``chunk_bytes`` (a multiple of
    :data:`HUGE_PAGE`), up to ``keep_bytes`` of them kept for reuse once emptied.
    Thread-safe."""

    def __init__(self, chunk_bytes: int = 2 * HUGE_PAGE, keep_bytes: int = KEEP_BYTES) -> None:
        if chunk_bytes < HUGE_PAGE or chunk_bytes % HUGE_PAGE:
            raise ValueError(f"chunk_bytes must be a multiple of {HUGE_PAGE}")
        if keep_bytes < 0:
            raise ValueError("keep_bytes must be 0 or more")
        self.chunk_bytes = chunk_bytes
        self._keep = keep_bytes // chunk_bytes
        #: Emptied mappings, the last one given back on the right (its pages likeliest
        #: still in the caches).
        self._free: deque[mmap.mmap] = deque()
        self._chunk: memoryview | None = None
        self._used = 0
        self._lock = threading.Lock()

    @property
    def kept(self) -> int:
        """Emptied mappings waiting for reuse."""
        return len(self._free)

    def _next_chunk(self) -> memoryview:
        """A kept mapping, else a fresh one, viewed through an object of its own whose
        end (once the last body carved from it is gone) gives the mapping back."""
        try:
            m = self._free.pop()
        except IndexError:
            m = _mapping(self.chunk_bytes)
        # The numpy array is the exporter every body's memoryview holds: it is freed
        # exactly when the last body (or anything made from one) is, which a
        # memoryview of the mapping itself cannot tell anyone.
        holder = np.frombuffer(m, dtype=np.uint8)
        weakref.finalize(holder, _give_back, self._free, self._keep, m).atexit = False
        return memoryview(holder)

    def take(self, nbytes: int) -> memoryview:
        """A writable buffer of exactly ``nbytes``, its contents undefined (a reused
        mapping holds earlier bodies' bytes)."""
        if nbytes > self.chunk_bytes // 2:
            return memoryview(_mapping(-(-nbytes // HUGE_PAGE) * HUGE_PAGE))[:nbytes]
        # 64-byte aligned starts: each body on cache lines of its own.
        need = (nbytes + 63) & ~63
        with self._lock:
            if self._chunk is None or self._used + need > self.chunk_bytes:
                self._chunk, self._used = self._next_chunk(), 0
            start = self._used
            self._used += need
            return self._chunk[start:start + nbytes]
