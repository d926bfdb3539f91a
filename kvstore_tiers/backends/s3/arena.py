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
mapped. Nothing is freed explicitly: each body is a memoryview that keeps its
mapping alive, and a mapping is unmapped when the last body carved from it is
gone, so a body can be handed to the core and dropped like ``bytes``. A body
larger than half a chunk gets a mapping of its own. Small chunks bound what one
body kept long (a held body whose load never comes, for up to the hold time)
keeps resident: its chunk, not a large arena.

Mappings are not reused: every load maps afresh, so every load pays the kernel's
zeroing (and, where free huge pages are short, its compaction) for its bodies, a
fault per 2 MiB instead of one per 4 KiB.

Only worth it where transparent huge pages are on for advised mappings
(:func:`huge_pages_available`): without them a fresh mapping faults page by page
on every load, where the allocator would have reused the memory of the last.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from pathlib import Path

#: The size of a huge page on x86-64 and arm64 with 4 KiB base pages.
HUGE_PAGE = 2 << 20
#: Where Linux says whether transparent huge pages back advised mappings.
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


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


def _mapping(nbytes: int) -> memoryview:
    """A fresh anonymous mapping of ``nbytes``, advised to use huge pages."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # Refused (a kernel without THP): plain pages, still correct.
    with contextlib.suppress(OSError):
        m.madvise(mmap.MADV_HUGEPAGE)
    return memoryview(m)


class BodyArena:
    """Writable buffers for bodies, from mappings of ``chunk_bytes`` (a multiple of
    :data:`HUGE_PAGE`). Thread-safe."""

    def __init__(self, chunk_bytes: int = 2 * HUGE_PAGE) -> None:
        if chunk_bytes < HUGE_PAGE or chunk_bytes % HUGE_PAGE:
            raise ValueError(f"chunk_bytes must be a multiple of {HUGE_PAGE}")
        self.chunk_bytes = chunk_bytes
        self._chunk: memoryview | None = None
        self._used = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> memoryview:
        """A writable buffer of exactly ``nbytes``, its contents undefined."""
        if nbytes > self.chunk_bytes // 2:
            return _mapping(-(-nbytes // HUGE_PAGE) * HUGE_PAGE)[:nbytes]
        # 64-byte aligned starts: each body on cache lines of its own.
        need = (nbytes + 63) & ~63
        with self._lock:
            if self._chunk is None or self._used + need > self.chunk_bytes:
                self._chunk, self._used = _mapping(self.chunk_bytes), 0
            start = self._used
            self._used += need
            return self._chunk[start:start + nbytes]
