"""Does a process the tests start die with the test process, even a SIGKILLed one?

:func:`children_die_with_parent` runs ``code`` in a new Python process (the
"test process"), waits for it to print ``ready``, SIGKILLs it, and then waits
for every child it had to be gone. A child adopted by init and not yet reaped
is a zombie: dead, and counted as gone.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _children(pid: int) -> list[int]:
    """The PIDs whose parent is ``pid`` (from /proc, whatever their namespace)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def children_die_with_parent(code: str, timeout_s: float = 60.0) -> tuple[int, list[int]]:
    """Run ``code`` (it starts children, then prints ``ready``) in a process, SIGKILL
    that process, and assert that all its children die within 10 s; return its PID and
    theirs."""
    parent = subprocess.Popen(
        [sys.executable, "-c", f"{code}\nprint('ready', flush=True)\nimport time\n"
         "time.sleep(600)\n"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"})
    try:
        assert parent.stdout is not None
        ready, _, _ = select.select([parent.stdout], [], [], timeout_s)
        line = parent.stdout.readline() if ready else ""
        assert line.strip() == "ready", (line, parent.poll())
        children = _children(parent.pid)
        assert children, "the code started no child"
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while left := [pid for pid in children if _alive(pid)]:
            assert time.monotonic() < deadline, f"children outlived their parent: {left}"
            time.sleep(0.05)  # polling the kernel's kill, not a test condition
        return parent.pid, children
    finally:
        if parent.poll() is None:
            parent.kill()
        parent.wait()
        if parent.stderr is not None:
            parent.stderr.close()
        if parent.stdout is not None:
            parent.stdout.close()
