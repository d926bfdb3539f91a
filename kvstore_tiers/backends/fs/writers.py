"""Who owns a temp file: writer ids held by ``flock``, and the sweep of dead writers' temp files.

Every process that opens an fs namespace is a *writer* with a random id. It
holds ``flock`` on ``<namespace>/.writer-<id>`` for as long as it is open,
and every temp file it writes is named ``<object>.<id><thread tag><n>.tmp``.
A writer killed mid-write (SIGKILL, OOM) leaves its temp file behind, and its
lock file unlocked: the kernel drops an ``flock`` with its last descriptor.
So a temp file is stale exactly when its writer's lock file is missing or can
be locked by someone else -- a check that holds across processes and PID
namespaces on one kernel, and never takes a temp file a live writer owns.

The lock file also holds the writer's bytes reserved and not yet written (8
bytes, little-endian), which the capacity count adds to what it finds on
disk (:mod:`.capacity`); a dead writer's reservation dies with it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import os
import struct
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

__all__ = ["ID_LEN", "TEMP_SUFFIX", "WriterLock", "WriterTable", "owner_of", "sweep_stale"]

#: Length of a writer id (hex) at the start of a temp file's tag.
ID_LEN = 12
TEMP_SUFFIX = ".tmp"
#: A writer's lock file in the namespace directory is this prefix plus its id.
LOCK_PREFIX = ".writer-"
_U64 = struct.Struct("<Q")


def owner_of(filename: str) -> str | None:
    """The writer id in a temp file's name (``<object>.kvf.<id>...tmp``), or None."""
    if not filename.endswith(TEMP_SUFFIX):
        return None
    _head, dot, tag = filename[: -len(TEMP_SUFFIX)].rpartition(".")
    if not dot or len(tag) < ID_LEN:
        return None
    return tag[:ID_LEN]


class WriterLock:
    """This process's writer id for one namespace directory, held until :meth:`close`.

    Thread-safe. :meth:`temp_name` gives temp-file names carrying the id;
    :meth:`set_reserved` records this writer's outstanding reservation.
    """

    def __init__(self, base: Path) -> None:
        self.id = uuid.uuid4().hex[:ID_LEN]
        self.path = base / f"{LOCK_PREFIX}{self.id}"
        # Locked before it gets its name, so no sweep ever sees it unlocked.
        tmp = base / f".new{LOCK_PREFIX}{self.id}"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.pwrite(fd, _U64.pack(0), 0)
        os.rename(tmp, self.path)
        self._fd: int | None = fd
        self._local = threading.local()

    def temp_name(self, path: str) -> str:
        """A temp-file name beside ``path`` no other writer or thread uses (no
        uuid per block: this runs on every store holding the GIL)."""
        local = self._local
        tag = getattr(local, "tag", None)
        if tag is None:
            tag = local.tag = self.id + uuid.uuid4().hex[:6]
            local.seq = itertools.count()
        return f"{path}.{tag}{next(local.seq):x}{TEMP_SUFFIX}"

    def set_reserved(self, nbytes: int) -> None:
        """Record this writer's bytes reserved and not yet written (callers serialize)."""
        if self._fd is not None:
            os.pwrite(self._fd, _U64.pack(max(0, nbytes)), 0)

    def close(self) -> None:
        """Give up the id: the lock file goes, then the lock."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            os.close(fd)


class WriterTable:
    """Which writer ids of a namespace directory are alive, asked once per id per pass.

    ``base`` is the namespace directory whose writers :meth:`scan_dir` lists;
    :meth:`alive` takes another namespace directory where the temp file is
    in one (a sweep over a whole ``root_dir``).
    """

    def __init__(self, base: Path) -> None:
        self.directory = str(base)
        self._live: dict[tuple[str, str], int] = {}  # (dir, id) -> reserved bytes
        # (dir, id) -> fd holding its lock (None: no lock file)
        self._dead: dict[tuple[str, str], int | None] = {}
        self.swept_files = 0
        self.swept_bytes = 0

    def alive(self, wid: str, directory: str | None = None) -> bool:
        """Whether writer ``wid`` of namespace ``directory`` (default: ours) holds its lock."""
        key = (directory or self.directory, wid)
        if key in self._live:
            return True
        if key in self._dead:
            return False
        try:
            fd = os.open(os.path.join(key[0], f"{LOCK_PREFIX}{wid}"), os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            self._dead[key] = None
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                os.close(fd)
                raise
            data = os.pread(fd, _U64.size, 0)
            os.close(fd)
            self._live[key] = _U64.unpack(data)[0] if len(data) == _U64.size else 0
            return True
        self._dead[key] = fd  # ours now: nobody else can claim it while we sweep
        return False

    def scan_dir(self) -> None:
        """Look at every writer's lock file (so :meth:`reserved` sees all live writers)."""
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(self.directory):
                if name.startswith(LOCK_PREFIX) and len(name) == len(LOCK_PREFIX) + ID_LEN:
                    self.alive(name[len(LOCK_PREFIX):])

    def reserved(self) -> int:
        """Bytes reserved by the live writers seen so far."""
        return sum(self._live.values())

    def close(self) -> None:
        """Remove the dead writers' lock files (their temp files are gone by now)."""
        for (directory, wid), fd in self._dead.items():
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(directory, f"{LOCK_PREFIX}{wid}"))
                os.close(fd)
        self._dead.clear()


def _temp_files(base: Path) -> Iterator[tuple[str, str]]:
    for dirpath, _dirs, files in os.walk(base):
        for fn in files:
            if fn.endswith(TEMP_SUFFIX):
                yield os.path.join(dirpath, fn), fn


def sweep_stale(base: Path, walk: bool = False) -> tuple[int, int]:
    """Remove every temp file under ``base`` (a namespace directory, or with
    ``walk`` a whole ``root_dir``) whose writer is not alive; returns (files,
    bytes on disk) removed. Never a live writer's file.

    Without ``walk`` it walks the tree only when a dead writer's lock file is
    left (a writer was killed) or a temp file of no known writer may exist, so
    a clean start costs one directory listing.
    """
    table = WriterTable(base)
    try:
        table.scan_dir()
        if not walk and not table._dead and not _legacy_temps_possible(base):
            return 0, 0
        for path, fn in _temp_files(base):
            wid = owner_of(fn)
            # <namespace>/<shard>/<temp>: the writer's lock is in the namespace directory.
            if wid is not None and table.alive(wid, os.path.dirname(os.path.dirname(path))):
                continue
            try:
                size = os.stat(path).st_blocks * 512
                os.unlink(path)
            except FileNotFoundError:
                continue
            table.swept_files += 1
            table.swept_bytes += size
        return table.swept_files, table.swept_bytes
    finally:
        table.close()


def _legacy_temps_possible(base: Path) -> bool:
    """True once per namespace directory made before writer ids existed (its
    temp files carry no writer lock): the first sweep walks it and leaves a
    marker."""
    marker = base / ".temps-swept"
    if marker.exists():
        return False
    marker.touch()
    return True
