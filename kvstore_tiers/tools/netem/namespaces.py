"""Network namespaces netem and the tests make: their names, removing those a killed
process left behind, and entering one from a thread.

A namespace made with ``ip netns add`` outlives the process that made it (a
bind mount under ``/var/run/netns`` holds it): a process killed by SIGKILL
leaves its namespaces, their veth pairs (one end may be in the root namespace)
and the rules and qdiscs inside them. So every such name carries its maker's
PID, ``PREFIX<pid>-<tag>``, and :func:`remove_orphans` deletes the namespaces of
a prefix whose maker is gone: each maker sweeps before it makes its own. A PID
reused since by another process keeps its orphans until that process ends.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import subprocess
import uuid
from collections.abc import Iterator

CLONE_NEWNET = 0x40000000


def owned_name(prefix: str, tag: str | None = None) -> str:
    """``PREFIX<this pid>-<tag>`` (a random tag by default)."""
    return f"{prefix}{os.getpid()}-{tag or uuid.uuid4().hex[:6]}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_orphans(prefix: str) -> list[str]:
    """Delete the namespaces named ``PREFIX<pid>-...`` whose process ``pid`` is gone;
    return their names."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                            timeout=30).stdout
    pattern = re.compile(rf"{re.escape(prefix)}(\d+)-\S+")
    gone = []
    for line in listed.splitlines():
        m = pattern.fullmatch(line.split(" ", 1)[0]) if line.strip() else None
        if m and not _alive(int(m.group(1))):
            subprocess.run(["ip", "netns", "del", m.group(0)], capture_output=True, timeout=30)
            gone.append(m.group(0))
    return gone


@contextlib.contextmanager
def inside(netns: str | None) -> Iterator[None]:
    """Run the block in network namespace ``netns`` (None: where it is): a socket
    made in it stays in that namespace after the block. Only the calling thread
    enters (``setns``), and it leaves at the block's end."""
    if netns is None:
        yield
        return
    libc = ctypes.CDLL(None, use_errno=True)
    here = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        there = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
        try:
            if libc.setns(there, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {netns}")
        finally:
            os.close(there)
        try:
            yield
        finally:
            if libc.setns(here, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back")
    finally:
        os.close(here)
