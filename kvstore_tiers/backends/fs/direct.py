"""O_DIRECT for the fs tier: whether a directory takes it, and the aligned buffers it needs.

O_DIRECT wants page-aligned lengths AND addresses (EINVAL otherwise).
Primary rows are page aligned; a frame's header is written into, and read
from, a page of this thread's own anonymous memory (mmap memory is page
aligned), so a raw payload moves between the row and the disk with no copy.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
import uuid

__all__ = ["O_DIRECT", "PAGE", "ThreadPages", "address", "aligned", "probe_o_direct"]

PAGE = mmap.PAGESIZE
O_DIRECT = getattr(os, "O_DIRECT", 0)

Buffer = bytes | bytearray | memoryview


def address(buf: Buffer) -> int:
    """Memory address of a buffer's first byte (for O_DIRECT alignment checks).

    On the I/O threads for every block, holding the GIL: ctypes takes ~0.5 us
    for a writable buffer (a primary row), numpy ~4 us (read-only ones).
    """
    if not len(buf):
        return 0
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(buf))  # type: ignore[arg-type]
    except TypeError:  # read-only
        import numpy as np

        return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def aligned(buf: Buffer) -> bool:
    """True if ``buf`` can be an O_DIRECT transfer: page-aligned length and address."""
    return len(buf) % PAGE == 0 and address(buf) % PAGE == 0


def probe_o_direct(directory: str) -> bool:
    """True if an aligned O_DIRECT write works in ``directory``."""
    if not O_DIRECT:
        return False
    path = os.path.join(directory, f".o_direct_probe_{uuid.uuid4().hex}")
    page = mmap.mmap(-1, PAGE)
    try:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_EXCL | O_DIRECT, 0o644)
        try:
            os.write(fd, page)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        page.close()
        with contextlib.suppress(OSError):
            os.remove(path)


class ThreadPages:
    """Each thread's page-aligned scratch pages, grown on demand, never shared."""

    def __init__(self) -> None:
        self._local = threading.local()

    def read_pages(self, n: int) -> list[tuple[memoryview, memoryview]]:
        """Page pairs for a load batch of ``n``: each file's frame header (its
        first ``readv`` part) and its overflow page (the read's last part)."""
        pages: list[tuple[memoryview, memoryview]] = getattr(self._local, "pages", [])
        if len(pages) < n:
            view = memoryview(mmap.mmap(-1, 2 * n * PAGE))
            pages = self._local.pages = [(view[2 * i * PAGE:(2 * i + 1) * PAGE],
                                          view[(2 * i + 1) * PAGE:(2 * i + 2) * PAGE])
                                         for i in range(n)]
        return pages

    def header_pages(self, n: int) -> list[memoryview]:
        """Frame-header pages for a store batch of ``n`` (each file's first ``writev`` part)."""
        pages: list[memoryview] = getattr(self._local, "headers", [])
        if len(pages) < n:
            view = memoryview(mmap.mmap(-1, n * PAGE))
            pages = self._local.headers = [view[i * PAGE:(i + 1) * PAGE] for i in range(n)]
        return pages
