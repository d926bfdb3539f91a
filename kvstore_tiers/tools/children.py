"""Child processes that die with the process that started them.

:func:`die_with_parent` is a ``preexec_fn`` for :class:`subprocess.Popen`: the
child asks the kernel (``prctl(PR_SET_PDEATHSIG, SIGKILL)``) to SIGKILL it when
its parent dies, however the parent dies: an ``atexit`` hook or a ``finally``
stops children on a normal exit, but a parent killed by SIGKILL (a CI job's
timeout, the OOM killer) runs neither, and its servers, proxies and engines
would keep running. The setting survives ``execve`` of an ordinary binary (so
``ip netns exec`` and the command it execs keep it), not of a set-user-ID one.

The kernel sends the signal when the *thread* that forked the child exits, not
only the process: start such children from a thread that lives as long as they
should (the main thread), never from a short-lived worker thread.
"""

from __future__ import annotations

import ctypes
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:  # pragma: no cover - runs in the child, before exec
    """Have the kernel SIGKILL this process when its parent dies (a ``preexec_fn``).

    A parent that dies between the fork and this call (microseconds) is not seen."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
