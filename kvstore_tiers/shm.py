"""Stale vLLM offload regions in /dev/shm: find them, remove them.

vLLM's CPU primary tier lives in ``/dev/shm/vllm_offload_<engine id>.mmap``.
An engine stopped with vLLM's default shutdown (abort, ``--shutdown-timeout
0``), killed, or crashed leaves that file behind, and /dev/shm is memory: every
restart would leak ``cpu_bytes_to_use``. :func:`sweep_once` runs when the
first tier of a process starts and removes regions that no live process uses
(:func:`sweep_stale_regions`); the process's other tiers, started a moment
later, would only read every ``/proc/<pid>/maps`` again and find nothing new.

A region is removed only when all of these hold:

* its name matches ``vllm_offload_*.mmap`` and it is a regular file owned by
  this user (another user's region is not ours to judge);
* neither its modification nor its change time is within ``min_age_s``: an
  engine creating its region right now (``O_EXCL`` create, ``ftruncate``,
  population) is never a candidate;
* no process whose ``/proc/<pid>/maps`` or ``/proc/<pid>/fd`` we can read maps
  it or holds it open (vLLM's joiners hold the file open while they wait for
  its size, so a region being joined is in use too).

The scan is read-only except for the final ``unlink`` of each candidate;
every failure is logged and skipped, never raised into the engine. Processes in
another PID namespace are invisible here; a container normally has its own
/dev/shm as well, and ``KVSTORE_TIERS_SWEEP_SHM=0`` turns the sweep off where
engines in other PID namespaces share this /dev/shm (``--ipc=host``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
import time
from pathlib import Path

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PATTERN = "vllm_offload_*.mmap"
#: Regions younger than this are left alone (creation in progress elsewhere).
MIN_AGE_S = 10.0

_once_lock = threading.Lock()
_swept = False  # this process has swept (see sweep_once)


def inodes_in_use(proc: Path, directory: Path) -> set[tuple[int, int]]:
    """(device, inode) of every file under ``directory`` that a readable process maps or opens."""
    dev = os.stat(directory).st_dev
    dev_text = f"{os.major(dev):02x}:{os.minor(dev):02x}"
    prefix = str(directory) + "/"
    used: set[tuple[int, int]] = set()
    for pid_dir in proc.iterdir():
        if not pid_dir.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for line in (pid_dir / "maps").read_text().splitlines():
                # address perms offset dev inode [path]
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].startswith(prefix) and parts[3] == dev_text:
                    used.add((dev, int(parts[4])))
        with contextlib.suppress(OSError):
            for fd in (pid_dir / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if not os.readlink(fd).startswith(prefix):
                        continue
                    st = os.stat(fd)  # follows the link to the open file itself
                    used.add((st.st_dev, st.st_ino))
    return used


def find_stale_regions(directory: Path = SHM_DIR, *, min_age_s: float = MIN_AGE_S,
                       proc: Path = Path("/proc")) -> list[Path]:
    """The regions under ``directory`` that :func:`sweep_stale_regions` would remove."""
    now = time.time()
    uid = os.getuid()
    candidates: list[tuple[Path, os.stat_result]] = []
    for path in directory.glob(PATTERN):
        try:
            st = path.lstat()
        except OSError:
            continue
        if (stat.S_ISREG(st.st_mode) and st.st_uid == uid
                and now - max(st.st_mtime, st.st_ctime) >= min_age_s):
            candidates.append((path, st))
    if not candidates:
        return []
    used = inodes_in_use(proc, directory)
    return [p for p, st in candidates if (st.st_dev, st.st_ino) not in used]


def sweep_stale_regions(directory: Path = SHM_DIR, *, min_age_s: float = MIN_AGE_S) -> int:
    """Remove stale vLLM offload regions (module docstring); returns the bytes freed.

    Never raises: a region that cannot be inspected or removed is kept and logged.
    """
    if os.environ.get("KVSTORE_TIERS_SWEEP_SHM", "1") == "0":
        return 0
    freed = 0
    try:
        stale = find_stale_regions(directory, min_age_s=min_age_s)
    except OSError as e:
        logger.warning("kvstore_tiers: cannot scan %s for stale vLLM regions: %s", directory, e)
        return 0
    for path in stale:
        try:
            size = path.stat().st_size
            path.unlink()
        except OSError as e:
            logger.warning("kvstore_tiers: cannot remove stale vLLM region %s: %s", path, e)
            continue
        freed += size
        logger.warning("kvstore_tiers: removed stale vLLM offload region %s (%d bytes, "
                       "left by an engine that did not shut down)", path, size)
    return freed


def sweep_once() -> int:
    """:func:`sweep_stale_regions` of /dev/shm the first time a process calls it; 0 after.

    Every tier calls it at start: the first one sweeps, the rest of the
    process's tiers skip the scan. Never raises.
    """
    global _swept
    with _once_lock:
        if _swept:
            return 0
        _swept = True
        return sweep_stale_regions()
