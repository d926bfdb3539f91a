"""Can this process build private networks here: namespaces, veth, netfilter and tc?

One check for everything under :mod:`kvstore_tiers.tools.netem` and the tests'
fabric of network namespaces (``tests/netns.py``). :func:`unavailable` returns
``None`` when they can be used, else the reason, in this order:

1. the kernel has network namespaces (``/proc/self/ns/net``);
2. the process holds ``CAP_NET_ADMIN`` and ``CAP_SYS_ADMIN`` in its *effective*
   set (``CapEff`` of ``/proc/self/status``): root in a container without them,
   or a non-root user granted them, is judged by what it can do, not its uid;
3. the commands are installed (``ip`` and ``tc`` from iproute2, ``iptables``);
4. a real probe: a throw-away namespace holding a veth pair with a TBF qdisc
   and a netfilter rule is made and deleted. A seccomp filter, a read-only
   ``/var/run/netns`` or a kernel without ``veth``, ``sch_tbf`` or iptables'
   tables fails here, with the failing command's own words.

The answer is computed once per process (the probe takes a few tens of ms).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import uuid
from pathlib import Path

#: Capability bits (linux/capability.h) the namespaces, veth, tc and netfilter need.
NEEDED_CAPS = {"CAP_NET_ADMIN": 12, "CAP_SYS_ADMIN": 21}
#: Commands and the Debian packages that have them.
TOOLS = {"ip": "iproute2", "tc": "iproute2", "iptables": "iptables"}
#: The probe's namespace is this, the process's PID, a dash and a random tag.
PROBE_PREFIX = "kvt-cap-"


def missing_caps(status: str) -> list[str]:
    """The capabilities of :data:`NEEDED_CAPS` not in the ``CapEff:`` line of
    ``status`` (the text of ``/proc/<pid>/status``); all of them if it has none."""
    for line in status.splitlines():
        if line.startswith("CapEff:"):
            eff = int(line.split()[1], 16)
            return [name for name, bit in NEEDED_CAPS.items() if not eff >> bit & 1]
    return list(NEEDED_CAPS)


def _probe() -> str | None:
    """Make and delete a namespace with a veth pair, a TBF qdisc and a DROP rule;
    None when every step worked, else the step that failed and why."""
    ns = f"{PROBE_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    steps = [
        ["ip", "netns", "add", ns],
        ["ip", "-n", ns, "link", "add", "p0", "type", "veth", "peer", "name", "p1"],
        ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "p0", "root", "tbf",
         "rate", "1mbit", "burst", "64kb", "latency", "1s"],
        ["ip", "netns", "exec", ns, "iptables", "-w", "-I", "INPUT", "-s", "10.0.0.1",
         "-j", "DROP"],
    ]
    try:
        for cmd in steps:
            try:
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
            except (OSError, subprocess.TimeoutExpired) as exc:
                return f"`{' '.join(cmd)}` failed: {exc}"
            if res.returncode != 0:
                return f"`{' '.join(cmd)}` failed: {res.stderr.strip() or res.returncode}"
        return None
    finally:  # the namespace takes the veth pair, the qdisc and the rule with it
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def why_unavailable(status: str, ns_supported: bool, which: dict[str, str | None]) -> str | None:
    """The reason from what was read (``status``: ``/proc/self/status``'s text;
    ``which``: each of :data:`TOOLS`' path or None), before any probe; None: go on."""
    if not ns_supported:
        return "this kernel has no network namespaces (CONFIG_NET_NS)"
    caps = missing_caps(status)
    if caps:
        return (f"this process lacks {' and '.join(caps)} in its effective capabilities "
                "(network namespaces, veth, tc and netfilter need them; run as root)")
    missing = [tool for tool, path in which.items() if path is None]
    if missing:
        packages = sorted({TOOLS[t] for t in missing})
        return f"{', '.join(missing)} not found (apt-get install {' '.join(packages)})"
    return None


@functools.cache
def unavailable() -> str | None:
    """None when network namespaces, veth, netfilter and tc can be used by this
    process, else why not (see the module's docstring)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError as exc:
        return f"cannot read /proc/self/status: {exc}"
    why = why_unavailable(status, Path("/proc/self/ns/net").exists(),
                          {tool: shutil.which(tool) for tool in TOOLS})
    return why or _probe()
