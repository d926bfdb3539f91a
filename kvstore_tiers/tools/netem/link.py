"""A bandwidth-capped link: a network namespace joined to this one by a veth pair.

``CappedLink(rate_mbit)`` makes namespace ``kvd<pid>-<n>`` (and first removes those of
processes that died without removing theirs: :mod:`.namespaces`), a veth pair with
``10.231.N.1/30`` on this side and ``10.231.N.2/30`` inside, and a TBF qdisc
(token bucket, ``rate_mbit`` Mbit/s, a burst of 10 ms of the rate) on *both*
ends, so each direction is capped. Its queue holds a second of the rate: a
cap, not a lossy link (a shallow queue drops a fresh connection's SYN-ACK
behind 64 downloads, and its retry comes a second later). A socket listening at
:attr:`inner` inside the namespace (:mod:`kvstore_tiers.tools.netem.delay` with
``netns=``) is reached from here only through the capped pair. Needs CAP_NET_ADMIN,
CAP_SYS_ADMIN and iproute2 (``ip``, ``tc``):
:func:`kvstore_tiers.tools.netem.capability.unavailable` says whether this process can.
Everything is removed on exit (deleting the namespace deletes its end of the pair, and
with it ours).
"""

from __future__ import annotations

import itertools
import os
import subprocess
from types import TracebackType

from kvstore_tiers.tools.netem import namespaces

_SEQ = itertools.count()
#: Every CappedLink's namespace is ``kvd<pid>-<n>`` (:mod:`.namespaces`).
PREFIX = "kvd"


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = ["ip", "netns", "exec", netns, *args] if netns else list(args)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        raise OSError(f"{' '.join(cmd)}: {res.stderr.strip()}")


def _free_subnet() -> int:
    used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
    for n in itertools.chain(range((os.getpid() + next(_SEQ)) % 250 + 1, 255), range(1, 255)):
        if f"10.231.{n}." not in used:
            return n
    raise OSError("no free 10.231.N.0/30 subnet")


class CappedLink:
    """A namespace behind a veth pair capped at ``rate_mbit`` each way (a context
    manager). :attr:`netns` names the namespace, :attr:`inner` its address."""

    def __init__(self, rate_mbit: float) -> None:
        self.rate_mbit = rate_mbit
        n = _free_subnet()
        self.netns = namespaces.owned_name(PREFIX, str(next(_SEQ)))
        tag = f"{os.getpid() % 100000}{n}"
        self._outer_if, self._inner_if = f"kvd{tag}h", f"kvd{tag}n"
        self.outer, self.inner = f"10.231.{n}.1", f"10.231.{n}.2"

    def _tbf(self, dev: str, netns: str | None) -> None:
        rate = int(self.rate_mbit * 1e6)
        burst = max(rate // 8 // 100, 64 << 10)  # 10 ms of the rate, at least 64 KiB
        _ip("tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{rate}bit",
            "burst", str(burst), "latency", "1s", netns=netns)

    def __enter__(self) -> CappedLink:
        namespaces.remove_orphans(PREFIX)
        _ip("ip", "netns", "add", self.netns)
        try:
            _ip("ip", "link", "add", self._outer_if, "type", "veth", "peer", "name",
                self._inner_if)
            _ip("ip", "link", "set", self._inner_if, "netns", self.netns)
            _ip("ip", "addr", "add", f"{self.outer}/30", "dev", self._outer_if)
            _ip("ip", "link", "set", self._outer_if, "up")
            _ip("ip", "addr", "add", f"{self.inner}/30", "dev", self._inner_if, netns=self.netns)
            _ip("ip", "link", "set", self._inner_if, "up", netns=self.netns)
            _ip("ip", "link", "set", "lo", "up", netns=self.netns)
            self._tbf(self._outer_if, None)
            self._tbf(self._inner_if, self.netns)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self._outer_if], capture_output=True, timeout=30)

    def __exit__(self, t: type[BaseException] | None, v: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
