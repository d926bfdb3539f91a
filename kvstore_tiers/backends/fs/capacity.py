"""Capacity control for the fs backend: a byte cap and a free-space floor, reserved before writing.

Shared by every process using the same namespace directory (two engines on
one node), through files in it:

* ``.usage``: the *ledger*, two little-endian u64: ``charged`` (bytes the
  namespace directory holds, as last counted, plus every reservation since)
  and ``pending`` (the part of ``charged`` reserved and not yet written).
  Read and written in place under ``flock(.usage)``.
* ``.writer-<id>``: each live writer's lock and its own outstanding
  reservation (:mod:`.writers`).
* ``.evict.lock``: one evictor at a time, across processes.

**Reserve before writing.** A store reserves its files' sizes (rounded up to
the filesystem block) in the ledger before it creates a temp file; a file
is written only if ``charged + size <= max_bytes`` and ``free - pending -
size >= min_free_bytes`` (``free`` from ``statvfs``, read holding the ledger
lock, so that no write can give its reservation back between the reading and
the decision). If not,
the writer evicts right there (blocking on the evict lock while another
process evicts) and asks again; a file that still finds no room within
:attr:`CapacityController.reserve_wait_s` fails its store (a miss, never a
torn file). After the publish the reservation becomes usage, or is given
back where nothing was written (the object existed, or the write failed).

**Count.** At start and at every eviction the evictor re-counts, under the
ledger lock, every block under the namespace directory (``st_blocks`` of
objects, temp files, shard directories, the ledger and markers), sweeps the
temp files of dead writers, and sets ``charged`` to that count plus the
reservations of the live writers. Then it deletes least-recently-used objects
(by mtime; loads refresh it) until ``charged`` is at most
``low_watermark * max_bytes`` and the floor is met with the band
``(high_watermark - low_watermark) * min_free_bytes`` to spare. The
background evictor does this whenever a reservation takes ``charged`` past
``high_watermark * max_bytes`` or free space within the band of the floor,
so writers rarely evict themselves.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from kvstore_tiers.backends.fs.config import FsConfig
from kvstore_tiers.backends.fs.layout import SUFFIX
from kvstore_tiers.backends.fs.writers import TEMP_SUFFIX, WriterLock, WriterTable, owner_of
from kvstore_tiers.errors import ConfigError

logger = logging.getLogger(__name__)

_LEDGER = struct.Struct("<QQ")


@contextlib.contextmanager
def _flock(path: Path, blocking: bool = True) -> Iterator[bool]:
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # releases the lock


def scan(base: Path, table: WriterTable | None = None
         ) -> tuple[int, list[tuple[float, int, str]]]:
    """(bytes on disk, [(mtime, bytes, path)] of every object) under ``base``.

    The bytes are every block under ``base``: objects, temp files,
    directories and small files alike. With ``table``, temp files of dead
    writers are removed instead of counted (a live writer's never are).
    """
    total = 0
    entries: list[tuple[float, int, str]] = []
    for dirpath, dirs, files in os.walk(base):
        with contextlib.suppress(FileNotFoundError):
            total += os.stat(dirpath).st_blocks * 512
        for fn in files:
            path = os.path.join(dirpath, fn)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            size = st.st_blocks * 512
            if fn.endswith(SUFFIX):
                entries.append((st.st_mtime, size, path))
            elif table is not None and fn.endswith(TEMP_SUFFIX):
                wid = owner_of(fn)
                if wid is None or not table.alive(wid, os.path.dirname(dirpath)):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                        table.swept_files += 1
                        table.swept_bytes += size
                    continue
            total += size
        dirs.sort()
    return total, entries


class CapacityController:
    """Keeps one fs namespace directory under its cap and its filesystem above its floor.

    Thread-safe; :meth:`reserve` and :meth:`release` run on the I/O threads.
    ``writer`` is the process's writer lock, where its reservations are
    recorded for the other processes' counts (a controller without one,
    e.g. an offline count, must not reserve).
    """

    #: How long a writer waits for room (evicting, then waiting for other
    #: writers' reservations to turn into evictable objects) before its store fails.
    reserve_wait_s = 5.0

    def __init__(
        self, base: Path, config: FsConfig, on_evicted: Callable[[list[str]], None],
        writer: WriterLock | None = None, check_interval_s: float = 10.0,
    ) -> None:
        self.base = base
        self.max_bytes: int | None = config.max_bytes
        self.min_free: int | None = config.min_free_bytes
        self.high, self.low = config.watermarks
        self.check_interval_s = check_interval_s
        self.block = max(512, os.statvfs(base).f_frsize)
        self._on_evicted = on_evicted
        self._writer = writer
        self._evict_lock_path = base / ".evict.lock"
        self._ledger_fd = os.open(base / ".usage", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o644)
        self._mu = threading.Lock()  # flock does not exclude this process's own threads
        self._reserved = 0  # this process's outstanding reservation
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstore_fs_evictor", daemon=True)
        self.evicted_objects = 0
        self.swept_temp_files = 0
        self.last_usage = 0
        self.refused = 0
        #: Bytes under the namespace directory that are not objects (shard
        #: directories, temp files in flight, the ledger), at the last count.
        self.overhead = 0

    # -- the ledger ---------------------------------------------------------------
    @contextlib.contextmanager
    def _ledger(self) -> Iterator[list[int]]:
        """[charged, pending] under the ledger lock; written back if changed."""
        with self._mu:
            fcntl.flock(self._ledger_fd, fcntl.LOCK_EX)
            try:
                data = os.pread(self._ledger_fd, _LEDGER.size, 0)
                old = list(_LEDGER.unpack(data)) if len(data) == _LEDGER.size else [0, 0]
                cur = list(old)
                yield cur
                if cur != old:
                    os.pwrite(self._ledger_fd, _LEDGER.pack(*(max(0, v) for v in cur)), 0)
            finally:
                fcntl.flock(self._ledger_fd, fcntl.LOCK_UN)

    def size_on_disk(self, nbytes: int) -> int:
        """What a file of ``nbytes`` is charged: whole filesystem blocks."""
        return -(-nbytes // self.block) * self.block

    def _free_bytes(self) -> int:
        st = os.statvfs(self.base)
        return st.f_bavail * st.f_frsize

    def _free_now(self) -> int | None:
        """Free bytes of the filesystem where a floor is set (None without one).

        Call it holding the ledger lock: a write finished after an earlier
        reading may have given its reservation back already, so its bytes
        would be missed in both ``free`` and ``pending``. Read under the lock,
        every write is in one or the other (a write in progress in both).
        """
        return self._free_bytes() if self.min_free is not None else None

    def _room(self, charged: int, pending: int, size: int, free: int | None) -> bool:
        if self.max_bytes is not None and charged + size > self.max_bytes:
            return False
        return free is None or self.min_free is None or free - pending - size >= self.min_free

    def _set_reserved(self, delta: int) -> None:
        # Under self._mu (held by _ledger's caller).
        self._reserved += delta
        if self._writer is not None:
            self._writer.set_reserved(self._reserved)

    # -- reserve / release (I/O threads) ------------------------------------------
    def reserve(self, sizes: Sequence[int]) -> int:
        """Reserve room for files of ``sizes`` (charged sizes, :meth:`size_on_disk`),
        in order; returns how many of the first ones got room (0: none within
        :attr:`reserve_wait_s`). Each granted one must be :meth:`release`-d."""
        deadline = time.monotonic() + self.reserve_wait_s
        while True:
            with self._ledger() as led:
                charged, pending = led
                free = self._free_now()
                n = add = 0
                for size in sizes:
                    if not self._room(charged + add, pending + add, size, free):
                        break
                    add += size
                    n += 1
                if n:
                    led[0], led[1] = charged + add, pending + add
                    self._set_reserved(add)
                    self.last_usage = charged + add
                    if self._past_high(charged + add, free, pending + add):
                        self._wake.set()
            if n:
                return n
            if self.max_bytes is not None and sizes[0] > self.max_bytes:
                self.refused += 1
                return 0  # can never fit
            # No room even for the first: evict here (or wait for the process
            # evicting now), then ask again.
            if not self._make_room(sizes[0]):
                if time.monotonic() > deadline:
                    self.refused += 1
                    return 0
                time.sleep(0.005)  # others' reservations will turn into evictable objects

    def _make_room(self, need: int) -> bool:
        """Evict for ``need`` more bytes unless a writer that held the evict
        lock before us already made room; True if there may be room now."""
        with _flock(self._evict_lock_path):
            with self._ledger() as led:
                charged, pending = led
                free = self._free_now()
            if self._room(charged, pending, need, free):
                return True
            return self._evict_locked(need) > 0

    def release(self, reserved: int, kept: int) -> None:
        """End a reservation of ``reserved`` bytes of which ``kept`` were written
        (``reserved`` for a published file, 0 where nothing was)."""
        with self._ledger() as led:
            led[0] -= reserved - kept
            led[1] -= reserved
            self._set_reserved(-reserved)

    def _past_high(self, charged: int, free: int | None, pending: int) -> bool:
        if self.max_bytes is not None and charged > self._mark(self.high):
            return True
        if free is None or self.min_free is None:
            return False
        return free - pending < self.min_free + self._band()

    def _mark(self, fraction: float) -> float:
        """A watermark: the fixed overhead plus ``fraction`` of the room left for objects."""
        assert self.max_bytes is not None
        return self.overhead + fraction * max(0, self.max_bytes - self.overhead)

    def _band(self) -> int:
        return int((self.high - self.low) * (self.min_free or 0))

    # -- eviction -----------------------------------------------------------------
    def evict_now(self, wait: bool = False, need: int = 0) -> int:
        """Re-count, sweep dead writers' temp files, evict LRU objects if over;
        returns objects removed (with ``need``, to leave room for that many
        more bytes). With ``wait=False`` it returns 0 at once when another
        evictor (thread or process) is at work."""
        with _flock(self._evict_lock_path, blocking=wait) as got:
            return self._evict_locked(need) if got else 0

    def _evict_locked(self, need: int) -> int:
        """:meth:`evict_now` with the evict lock held."""
        # The ledger stays locked from the count to the write, so a
        # reservation made meanwhile waits and lands on the new count.
        table = WriterTable(self.base)
        try:
            with self._ledger() as led:
                table.scan_dir()
                on_disk, entries = scan(self.base, table)
                pending = table.reserved()
                self.overhead = on_disk - sum(size for _m, size, _p in entries)
                total = on_disk + pending
                target = float("inf")
                if self.max_bytes is not None:
                    target = min(self._mark(self.low), self.max_bytes - need)
                need_free = 0
                if self.min_free is not None:
                    short = self.min_free + need - (self._free_bytes() - pending)
                    if short > 0:
                        need_free = short + self._band()
                removed: list[str] = []
                freed = 0
                if total > target or need_free:
                    entries.sort()  # oldest first
                    for _mtime, size, path in entries:
                        if total - freed <= target and freed >= need_free:
                            break
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(path)
                            removed.append(path)
                            freed += size
                led[0], led[1] = total - freed, pending
                self.last_usage = total - freed
        finally:
            table.close()
        if table.swept_files:
            self.swept_temp_files += table.swept_files
            logger.info("fs tier: removed %d temp files of killed writers (%d KiB) under %s",
                        table.swept_files, table.swept_bytes >> 10, self.base)
        if removed:
            self.evicted_objects += len(removed)
            self._on_evicted(removed)
            logger.info("fs tier: evicted %d objects (%d MiB) under %s",
                        len(removed), freed >> 20, self.base)
        return len(removed)

    # -- thread -------------------------------------------------------------------
    def start(self) -> None:
        """Count what is on disk (a restarted engine knows its usage), check
        that ``max_bytes`` and ``min_free_bytes`` leave room for a file, start
        the evictor. Raises ConfigError naming the key that does not."""
        self.evict_now(wait=True)
        problem = self._no_room_ever()
        if problem:
            os.close(self._ledger_fd)
            raise ConfigError(f"fs tier: {problem}")
        self._thread.start()

    def _no_room_ever(self) -> str | None:
        """Why not even one block could ever be written (None: it could)."""
        if self.max_bytes is not None and self.overhead + self.block > self.max_bytes:
            return (f"key 'max_bytes': {self.max_bytes} bytes leave no room for blocks: "
                    f"the namespace directory {self.base} itself takes {self.overhead} bytes "
                    "(its 4,096 shard directories and small files, counted in max_bytes)")
        if self.min_free is not None:
            st = os.statvfs(self.base)
            # Blocks reserved for root (f_bfree - f_bavail) are never free to us.
            size = (st.f_blocks - (st.f_bfree - st.f_bavail)) * st.f_frsize
            if self.min_free + self.overhead + self.block > size:
                return (f"key 'min_free_bytes': {self.min_free} bytes can never be free "
                        f"while this tier writes a block: the filesystem of {self.base} "
                        f"holds {size} bytes for files, {self.overhead} of them the "
                        "namespace directory's own")
        return None

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()
        os.close(self._ledger_fd)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.check_interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                with self._ledger() as led:
                    charged, pending = led
                    free = self._free_now()
                if self._past_high(charged, free, pending):
                    self.evict_now()
            except Exception:
                logger.exception("fs tier: eviction failed under %s", self.base)
