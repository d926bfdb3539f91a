"""Capacity control for the fs backend: a byte cap and a free-space floor.

Shared by every process using the same namespace directory (two engines on
one node), through two small files in it:

* ``.usage``: bytes on disk, as last counted, plus the writes processes have
  reported since; updated under ``flock(.usage.lock)``. Each process adds its
  writes in batches of at most ``flush_bytes``, so the shared figure lags the
  truth by at most one batch per process.
* ``.evict.lock``: one evictor at a time, across processes.

When the shared figure passes ``high_watermark * max_bytes`` (or free space
falls below ``min_free_bytes``), the evictor thread of the process that
noticed takes the evict lock, re-counts the real bytes on disk (``st_blocks``
of every object, so the index is rebuilt from disk, never trusted blindly),
and deletes least-recently-used objects (by mtime; loads refresh it) until
usage is below ``low_watermark * max_bytes`` and the floor is met. The count
also runs once at start, so a restarted engine knows what is on disk.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvstore_tiers.backends.fs.layout import walk_objects

logger = logging.getLogger(__name__)

_U64 = struct.Struct("<Q")


@contextlib.contextmanager
def _flock(path: Path, blocking: bool = True) -> Iterator[bool]:
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # releases the lock


def scan(base: Path) -> tuple[int, list[tuple[float, int, str]]]:
    """(bytes on disk, [(mtime, bytes, path)]) of every object under ``base``."""
    entries = [(st.st_mtime, st.st_blocks * 512, path) for path, st in walk_objects(base)]
    return sum(size for _m, size, _p in entries), entries


class CapacityController:
    """Keeps one fs namespace directory under its cap. Thread-safe."""

    def __init__(
        self, base: Path, config: Any, on_evicted: Callable[[int], None],
        flush_bytes: int | None = None, check_interval_s: float = 10.0,
    ) -> None:
        self.base = base
        self.max_bytes: int | None = config.max_bytes
        self.min_free: int | None = config.min_free_bytes
        self.high = config.high_watermark
        self.low = min(config.low_watermark, config.high_watermark)
        cap = self.max_bytes or 0
        self.flush_bytes = flush_bytes or max(1 << 20, min(64 << 20, cap // 100 or (64 << 20)))
        self.check_interval_s = check_interval_s
        self._on_evicted = on_evicted
        self._usage_path = base / ".usage"
        self._lock_path = base / ".usage.lock"
        self._evict_lock_path = base / ".evict.lock"
        self._pending = 0
        self._mu = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstore_fs_evictor", daemon=True)
        self.evicted_objects = 0
        self.last_usage = 0

    # -- shared usage counter -----------------------------------------------------
    def _read_usage(self) -> int:
        try:
            data = self._usage_path.read_bytes()
            return _U64.unpack(data)[0] if len(data) == _U64.size else 0
        except FileNotFoundError:
            return 0

    def _write_usage(self, value: int) -> None:
        tmp = self._usage_path.with_name(f".usage.{os.getpid()}.{threading.get_ident()}")
        tmp.write_bytes(_U64.pack(max(0, value)))
        os.replace(tmp, self._usage_path)

    def _add_usage(self, delta: int) -> int:
        with _flock(self._lock_path):
            value = self._read_usage() + delta
            self._write_usage(value)
            return value

    def on_written(self, nbytes: int) -> None:
        """Called after each published object (any I/O thread)."""
        with self._mu:
            self._pending += nbytes
            if self._pending < self.flush_bytes:
                return
            delta, self._pending = self._pending, 0
        usage = self._add_usage(delta)
        self.last_usage = usage
        if self.max_bytes is not None and usage > self.max_bytes:
            # Past the cap itself (the background evictor fell behind): evict
            # on this I/O thread before writing more, so the overshoot stays
            # within one flush batch per process.
            self.evict_now(wait=False)
        elif self._over(usage, slack=0):
            self._wake.set()

    # -- policy -------------------------------------------------------------------
    def _free_bytes(self) -> int:
        return shutil.disk_usage(self.base).free

    def _over(self, usage: int, slack: int) -> bool:
        if self.max_bytes is not None and usage + slack > self.high * self.max_bytes:
            return True
        return self.min_free is not None and self._free_bytes() < self.min_free

    def evict_now(self, wait: bool = False) -> int:
        """Count the real usage and evict LRU objects if over; returns objects removed.

        With ``wait=False`` it returns 0 at once when another evictor (thread
        or process) is already at work, since that one will do the job.
        """
        with _flock(self._evict_lock_path, blocking=wait) as got:
            if not got:
                return 0
            # The usage lock is held from the count to the final write, so a
            # writer's report made meanwhile waits and is added afterwards
            # instead of being overwritten by this count (a lost update would
            # let the store grow past its cap unnoticed). Writers only wait
            # on I/O threads, and only while an eviction runs.
            with _flock(self._lock_path):
                total, entries = scan(self.base)
                target = self.low * self.max_bytes if self.max_bytes is not None else float("inf")
                need_free = 0
                if self.min_free is not None:
                    need_free = max(0, self.min_free - self._free_bytes())
                    if need_free:  # free the floor plus the hysteresis band
                        need_free += int((self.high - self.low) * (self.max_bytes or self.min_free))
                removed = freed = 0
                if total > target or need_free:
                    entries.sort()  # oldest first
                    for _mtime, size, path in entries:
                        if total - freed <= target and freed >= need_free:
                            break
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(path)
                            removed += 1
                            freed += size
                self._write_usage(total - freed)
            self.last_usage = total - freed
        if removed:
            self.evicted_objects += removed
            self._on_evicted(removed)
            logger.info("fs tier: evicted %d objects (%d MiB) under %s",
                        removed, freed >> 20, self.base)
        return removed

    # -- thread -------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()
        with self._mu:
            delta, self._pending = self._pending, 0
        if delta:
            with contextlib.suppress(OSError):
                if self._over(self._add_usage(delta), slack=0):
                    self.evict_now(wait=True)  # leave the store under its cap

    def _run(self) -> None:
        first = True
        while not self._stop.is_set():
            try:
                if first or self._over(self._read_usage(), slack=self._pending):
                    self.evict_now()
                first = False
            except Exception:
                logger.exception("fs tier: eviction failed under %s", self.base)
            self._wake.wait(self.check_interval_s)
            self._wake.clear()
