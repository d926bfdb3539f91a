"""Names of the network namespaces netem and the tests make, and removing those a
killed process left behind.

A namespace made with ``ip netns add`` outlives the process that made it (a
bind mount under ``/var/run/netns`` holds it): a process killed by SIGKILL
leaves its namespaces, their veth pairs (one end may be in the root namespace)
and the rules and qdiscs inside them. So every such name carries its maker's
PID, ``PREFIX<pid>-<tag>``, and :func:`remove_orphans` deletes the namespaces of
a prefix whose maker is gone: each maker sweeps before it makes its own. A PID
reused since by another process keeps its orphans until that process ends.
"""

from __future__ import annotations

import os
import re
import subprocess
import uuid


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
