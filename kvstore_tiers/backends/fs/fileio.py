"""The fs tier's file operations, each one call.

* :func:`publish_file` (tmp, path, buffers, flags[, crc_of, crc_at]) -> bytes written: 0 if
  ``path`` exists already (nothing is written: objects are content-addressed,
  so another writer's copy is as good); else create ``tmp`` exclusively, one
  vectored write, close, rename to ``path``. A rename that reports EEXIST
  lost a publish race to another writer of the same object: 0, as if it had
  existed. A short write is followed by a write of the rest, so the error
  says why (ENOSPC on a full disk; EIO only when the kernel gives no reason).
  On any error ``tmp`` is removed and ``path`` is untouched.
* :func:`publish_files` (items, piece) -> per item, bytes written or the OSError:
  :func:`publish_file` for each (tmp, path, buffers, flags), errors returned
  rather than raised, so one full disk or missing directory fails its own
  item only. A store batch is one call. An item (tmp, path, buffers, flags,
  crc_of, crc_at) is written with the CRC-32C of ``buffers[crc_of]`` put
  little-endian at byte ``crc_at`` of a copy of ``buffers[0]`` (a frame's
  header, whose checksum field :mod:`kvstore_tiers.frame` names): the
  checksum costs no GIL re-take, and with ``piece`` (as for
  :func:`read_files`) each piece is checksummed, then written while in cache.
  Where :data:`PUBLISH_CRC` is False (the compiled call on a CPU without the
  CRC instruction) such an item is refused: checksum before publishing.
* :func:`read_files` (items, threads, piece) -> per item, (bytes read, file size) or the
  OSError: for each (path, buffers, flags), on up to ``threads`` threads at
  once (native only), open, one vectored read from
  offset 0, close; the size is the byte count when the read stopped short of
  filling ``buffers`` (it met end of file), else an ``fstat``'s. Errors are
  returned rather than raised. A load batch is one call. An item (path,
  buffers, flags, crc_of) also gets the CRC-32C of ``buffers[crc_of]`` once
  the read filled it: (n, size, crc), crc None where it was not computed
  (a short read, a CPU without the instruction, the Python twin), so the
  caller checksums it itself. The crc32c package releases and re-takes the
  GIL for every block; computed here, a load batch's checksums cost no
  re-take. With ``piece`` (:data:`CRC_PIECE` for a root in memory, see
  :func:`in_memory`), where the CPU folds the CRC, that buffer is read and
  checksummed ``piece`` bytes at a time, each while the copy left it in cache.
* :func:`exists_files` (paths) -> per path, whether it exists (as
  ``os.path.exists``): an async lookup's batch is one call.

O_DIRECT wants page-aligned lengths AND addresses (EINVAL otherwise).
Primary rows are page aligned; a frame's header is written from a page of the
calling thread's own anonymous memory (:class:`ThreadPages`; mmap memory is
page aligned), and read into the core's page-aligned buffers, so a raw
payload moves between the row and the disk with no copy. :func:`probe_o_direct` says
whether a directory takes O_DIRECT, :func:`in_memory` whether it would be
any use there.

:func:`publish_file` raises OSError with errno and the failing path, like ``os`` does. Each
exists twice: compiled (``_fsio.c``, built by setup.py where a C compiler
exists), which releases the GIL once per call, and the pure-Python twins
below, which release and re-take it for every syscall -- on a 2-core engine
with several I/O threads and the scheduler loop, each re-take is a wait.
The compiled set is used when importable; ``KVSTORE_TIERS_FS_NATIVE=0``
selects the Python set.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import re
import struct
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import crc32c

__all__ = [
    "CRC_PIECE",
    "MAX_ITEMS",
    "NATIVE",
    "O_DIRECT",
    "PAGE",
    "PUBLISH_CRC",
    "PublishItem",
    "ReadItem",
    "ThreadPages",
    "address",
    "aligned",
    "exists_files",
    "exists_files_py",
    "in_memory",
    "probe_o_direct",
    "publish_file",
    "publish_file_py",
    "publish_files",
    "publish_files_py",
    "read_file_py",
    "read_files",
    "read_files_py",
    "tmpfs_small_pages",
]

Buffer = Any  # bytes-like (a memoryview of a primary row, bytes, mmap)
#: One file for :func:`publish_files`: (tmp, path, buffers, flags[, crc_of, crc_at]).
PublishItem = tuple[str, str, Sequence[Buffer], int] | tuple[
    str, str, Sequence[Buffer], int, int, int]
#: One file for :func:`read_files`: (path, buffers, flags[, crc_of]).
ReadItem = tuple[str, Sequence[Buffer], int] | tuple[str, Sequence[Buffer], int, int]
#: What :func:`read_files` gives per item: (n, size), or (n, size, crc) with ``crc_of``.
ReadResult = tuple[int, int] | tuple[int, int, int | None]


PAGE = mmap.PAGESIZE
O_DIRECT = getattr(os, "O_DIRECT", 0)

def address(buf: Buffer) -> int:
    """Memory address of a buffer's first byte (for O_DIRECT alignment checks).

    On the I/O threads for every block, holding the GIL: ctypes for a
    writable buffer (a primary row) is several times cheaper than numpy,
    which is left for read-only ones.
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


#: The filesystems whose files are pages of memory.
_MEMORY_FS = frozenset({"tmpfs", "ramfs"})
#: Bytes of a row a read in memory moves and checksums at a time: a fraction
#: of a core's cache, so the checksum reads back what the copy just wrote.
CRC_PIECE = 256 * 1024
#: The kernel's huge-page policy for tmpfs, the chosen one in brackets.
_SHMEM_ENABLED = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


def _mount_of(directory: str, mounts: str) -> tuple[str, list[str]]:
    """(type, options) of the last-mounted filesystem whose mount point holds
    ``directory``, from the table ``mounts`` (Linux); ("", []) if unknown."""
    try:
        path = os.path.realpath(directory)
        with open(mounts, encoding="utf-8", errors="surrogateescape") as f:
            table = f.read().splitlines()
    except OSError:
        return "", []
    best, found = -1, ("", [])
    for line in table:
        fields = line.split()
        if len(fields) < 4:
            continue
        # Spaces, tabs, newlines and backslashes in a mount point are octal escapes.
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])
        if os.path.commonpath([path, point]) == point and len(point) >= best:
            best, found = len(point), (fields[2], fields[3].split(","))
    return found


def in_memory(directory: str, mounts: str = "/proc/self/mounts") -> bool:
    """True if ``directory`` is on tmpfs or ramfs (see :func:`_mount_of`).

    Their files are pages of memory: tmpfs accepts O_DIRECT (Linux 6.6 on)
    but a read is still the kernel's copy from those pages, and a buffered
    read lets the read call checksum each piece of a row while the copy has
    it in cache. False wherever it cannot tell.
    """
    return _mount_of(directory, mounts)[0] in _MEMORY_FS


def tmpfs_small_pages(directory: str, mounts: str = "/proc/self/mounts",
                      shmem_enabled: str = _SHMEM_ENABLED) -> bool:
    """True if ``directory`` is on a tmpfs that keeps every file in 4 KiB
    pages, where mounting it with ``huge=within_size`` would give files of
    2 MiB and more huge pages.

    That is a tmpfs mounted without ``huge=always`` or ``huge=within_size``
    (``huge=advise`` applies to memory maps only, not to reads), unless the
    kernel's ``shmem_enabled`` forces huge pages everywhere or denies them
    everywhere (then the mount option changes nothing). A read from a tmpfs
    copies one page at a time, so its per-page work is most of a load's
    CPU (see docs/benchmarks.md). False wherever it cannot tell.
    """
    kind, options = _mount_of(directory, mounts)
    if kind != "tmpfs":
        return False
    try:
        with open(shmem_enabled, encoding="ascii") as f:
            chosen = re.search(r"\[(\w+)\]", f.read())
    except OSError:  # a kernel without transparent huge pages: no huge= to mount
        return False
    if chosen is not None and chosen.group(1) in ("force", "deny"):
        return False
    return not {"huge=always", "huge=within_size"} & set(options)


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

    def header_pages(self, n: int) -> list[memoryview]:
        """Frame-header pages for a store batch of ``n`` (each file's first ``writev`` part)."""
        pages: list[memoryview] = getattr(self._local, "headers", [])
        if len(pages) < n:
            view = memoryview(mmap.mmap(-1, n * PAGE))
            pages = self._local.headers = [view[i * PAGE:(i + 1) * PAGE] for i in range(n)]
        return pages


def read_file_py(path: str, buffers: Sequence[Buffer], flags: int, crc_of: int = -1
                 ) -> ReadResult:
    """One file of :func:`read_files_py`: (bytes read, file size), with ``crc_of``
    (n, size, None) -- the twin leaves the checksum to the caller; raises OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | flags)
    try:
        n = os.readv(fd, buffers)
        size = os.fstat(fd).st_size if n == sum(len(b) for b in buffers) else n
        return (n, size) if crc_of < 0 else (n, size, None)
    except OSError as exc:
        exc.filename = path  # an fd's error names the file, as the compiled call's does
        raise
    finally:
        os.close(fd)


def _check_sum(buffers: Sequence[Buffer], crc_of: int, crc_at: int) -> None:
    """ValueError unless (crc_of, crc_at) fit ``buffers`` (see :func:`publish_files`)."""
    if crc_of >= 0 and not (0 < crc_of < len(buffers)
                            and 0 <= crc_at <= memoryview(buffers[0]).nbytes - 4):
        raise ValueError("crc_of must name a buffer after the first, and crc_at 4 bytes "
                         "of the first")


def publish_file_py(tmp: str, path: str, buffers: Sequence[Buffer], flags: int,
                    crc_of: int = -1, crc_at: int = -1) -> int:
    """Pure-Python :func:`publish_file`."""
    _check_sum(buffers, crc_of, crc_at)
    if os.path.exists(path):
        return 0
    if crc_of >= 0:
        with memoryview(buffers[0]) as first:
            # A copy of the header, page-aligned (mmap) where O_DIRECT wants it.
            head = mmap.mmap(-1, first.nbytes) if flags & O_DIRECT else bytearray(first.nbytes)
            head[:] = first.cast("B")
        struct.pack_into("<I", head, crc_at, crc32c.crc32c(buffers[crc_of]))
        buffers = [head, *buffers[1:]]
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC | flags, 0o644)
    try:
        try:
            n = os.writev(fd, buffers)
            total = sum(len(b) for b in buffers)
            if n != total:  # the filesystem is full or failing: the rest says why
                _write_rest(fd, buffers, n)
                n = total
        except OSError as exc:
            exc.filename = tmp
            raise
        finally:
            os.close(fd)
        try:
            os.replace(tmp, path)
        except FileExistsError:
            # Another writer published the same object first: it is there.
            os.unlink(tmp)
            return 0
        except OSError as exc:
            exc.filename, exc.filename2 = path, None  # name the target, as the C call does
            raise
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return n


def _write_rest(fd: int, buffers: Sequence[Buffer], done: int) -> None:
    """After a short write of ``done`` bytes, write the rest, so a failure
    raises the kernel's reason (ENOSPC on a full disk) rather than a bare
    short count; EIO if a write makes no progress without one."""
    for buf in buffers:
        with memoryview(buf) as view:
            rest = view.cast("B")[done:] if done < view.nbytes else view[:0]
            done = max(0, done - view.nbytes)
            while len(rest):
                w = os.write(fd, rest)
                if w == 0:
                    raise OSError(errno.EIO, "write made no progress")
                rest = rest[w:]


#: Most files one :func:`publish_files` or :func:`read_files` call takes.
MAX_ITEMS = 64


def _run_items(items: Sequence[tuple[Any, ...]], one: Callable[..., Any],
               buffers_at: int, writable: bool) -> list[Any]:
    """The Python twin of ``_fsio.c``'s ``run_items``: refuse a bad batch (too
    many items, a non-buffer, a read-only buffer to read into, a ``crc_of``
    past the buffers) before touching any file, then ``one(*item)`` per item,
    its OSError returned in its place."""
    if len(items) > MAX_ITEMS:
        raise ValueError(f"takes at most {MAX_ITEMS} items")
    for item in items:
        for b in item[buffers_at]:
            with memoryview(b) as view:
                if writable and view.readonly:
                    raise BufferError("buffers must be writable")
        if writable and len(item) > 3 and item[3] >= len(item[buffers_at]):
            raise ValueError("crc_of is not one of the item's buffers")
        if not writable and len(item) > 4:
            _check_sum(item[2], item[4], item[5] if len(item) > 5 else -1)
    out: list[Any] = []
    for item in items:
        try:
            out.append(one(*item))
        except OSError as exc:
            out.append(exc)
    return out


def publish_files_py(items: Sequence[PublishItem], piece: int = 0) -> list[int | OSError]:
    """Pure-Python :func:`publish_files` (``piece`` unused: the crc32c package
    checksums a whole buffer)."""
    return _run_items(items, publish_file_py, buffers_at=2, writable=False)


def read_files_py(items: Sequence[ReadItem], threads: int = 1, piece: int = 0
                  ) -> list[ReadResult | OSError]:
    """Pure-Python :func:`read_files`, one file after another (``threads`` and
    ``piece`` unused: the twin leaves checksums to the caller)."""
    return _run_items(items, read_file_py, buffers_at=1, writable=True)


def exists_files_py(paths: Sequence[str]) -> list[bool]:
    """Pure-Python :func:`exists_files`."""
    return [os.path.exists(p) for p in paths]


publish_file: Callable[..., int] = publish_file_py
publish_files: Callable[[Sequence[PublishItem], int], list[int | OSError]] = publish_files_py
read_files: Callable[[Sequence[ReadItem], int, int], list[ReadResult | OSError]] = read_files_py
exists_files: Callable[[Sequence[str]], list[bool]] = exists_files_py
if os.environ.get("KVSTORE_TIERS_FS_NATIVE", "1") != "0":
    with contextlib.suppress(ImportError):  # not compiled here: the Python set
        from kvstore_tiers.backends.fs._fsio import (
            exists_files,
            publish_file,
            publish_files,
            read_files,
        )
NATIVE = read_files is not read_files_py
#: Whether :func:`publish_files` takes items with a checksum to compute: the
#: Python twin does, the compiled call where the CPU has the CRC instruction.
PUBLISH_CRC = True
if NATIVE:
    from kvstore_tiers.backends.fs import _fsio

    # An extension built before publish_files took checksums lacks the constant.
    PUBLISH_CRC = bool(getattr(_fsio, "PUBLISH_CRC", 0))
