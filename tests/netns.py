"""Hosts on a private network for tests: Linux network namespaces joined by veth pairs.

:class:`Fabric` builds one *server* namespace holding a bridge (``10.199.S.1/24``)
and any number of *host* namespaces, each wired to the bridge by its own veth
pair (``10.199.S.10``, ``.11``, ...). Nothing is routed out of the fabric: no
namespace has a default route, and every address is one the fabric assigned,
so a test can only ever reach its own servers. ``S`` is picked per fabric
among the subnets no interface of the root namespace uses.

* :meth:`Fabric.spawn` starts a process inside a namespace (``ip netns exec``
  execs the command, so the PID is the process's own) and the fabric stops it
  by that PID at teardown; the kernel kills it if the test process dies
  first, even by SIGKILL (``PR_SET_PDEATHSIG``).
* :meth:`Fabric.cut` partitions a host from the server namespace with
  netfilter DROP rules (``iptables``) on both sides: packets from the host
  vanish at the server's INPUT hook and packets from the server vanish at the
  host's. A silent drop, as a dead link or a lost route looks to TCP (no RST,
  no local ``EPERM``): connections hang until their own timeouts.
  :meth:`Fabric.heal` deletes exactly those rules.
* :meth:`Fabric.close` (also the context manager's exit, and an ``atexit``
  hook for an interpreter that dies in between) kills every process it
  started, by PID, deletes the rules, then the namespaces, which takes their
  veths and the bridge with them. It runs whatever failed before it. A test
  process killed by SIGKILL runs none of it; its namespaces carry its PID
  (``kvf<pid>-<tag>-srv``, ``-h0``, ...) and the next fabric deletes them.

Needs CAP_NET_ADMIN and CAP_SYS_ADMIN, a kernel with network namespaces, and
the ``ip`` (iproute2) and ``iptables`` commands: :func:`require_netns` skips a
test with the reason when any is missing or a throw-away namespace cannot be
made (:func:`kvstore_tiers.tools.netem.capability.unavailable`, the one check
the bench's capped links use too).
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvstore_tiers.tools.children import die_with_parent
from kvstore_tiers.tools.netem import capability, namespaces

#: Every fabric's namespaces are ``kvf<pid>-<tag>-...`` (kvstore_tiers/tools/netem/namespaces.py).
PREFIX = "kvf"
#: The private /16 every fabric's /24 comes from.
FABRIC_NET = ipaddress.ip_network("10.199.0.0/16")


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), check=check, capture_output=True, text=True, timeout=30)


def require_netns() -> None:
    """Skip, with the reason, unless this process can build namespaces, veth pairs,
    netfilter rules and qdiscs here (:mod:`kvstore_tiers.tools.netem.capability`)."""
    why = capability.unavailable()
    if why:
        pytest.skip(why)


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 of FABRIC_NET no address of the root namespace is in."""
    # `ip -o -4 addr show`: "2: eth0    inet 10.0.0.5/24 brd ..." one address a line
    used = _run("ip", "-o", "-4", "addr", "show").stdout.splitlines()
    taken = [ipaddress.ip_interface(line.split()[3]).network for line in used]
    # Other fabrics' subnets are inside their own namespaces, invisible here;
    # two fabrics on one /24 would still never meet (no route joins them), and
    # the random start makes even that rare.
    subnets = list(FABRIC_NET.subnets(new_prefix=24))
    start = int.from_bytes(os.urandom(2), "big") % len(subnets)
    for net in subnets[start:] + subnets[:start]:
        if not any(net.overlaps(t) for t in taken):
            return net
    raise RuntimeError("every /24 of 10.199.0.0/16 is in use")


@dataclass
class Host:
    """One host namespace and its address on the fabric."""

    name: str
    netns: str
    address: str


@dataclass
class Fabric:
    """A server namespace with a bridge, and host namespaces on veths to it."""

    tag: str = field(default_factory=lambda: namespaces.owned_name(PREFIX))
    subnet: ipaddress.IPv4Network = field(default_factory=_free_subnet)
    hosts: dict[str, Host] = field(default_factory=dict)
    _namespaces: list[str] = field(default_factory=list)
    _procs: list[subprocess.Popen[Any]] = field(default_factory=list)
    _rules: list[tuple[str, list[str]]] = field(default_factory=list)
    _closed: bool = False

    def __post_init__(self) -> None:
        self.server_ns = f"{self.tag}-srv"
        self.server_address = str(self.subnet.network_address + 1)
        atexit.register(self.close)
        namespaces.remove_orphans(PREFIX)
        try:
            self._add_netns(self.server_ns)
            self._ns(self.server_ns, "ip", "link", "add", "br0", "type", "bridge")
            self._ns(self.server_ns, "ip", "addr", "add",
                     f"{self.server_address}/{self.subnet.prefixlen}", "dev", "br0")
            self._ns(self.server_ns, "ip", "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ building
    def _add_netns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._namespaces.append(name)
        self._ns(name, "ip", "link", "set", "lo", "up")

    def _ns(self, netns: str, *cmd: str) -> subprocess.CompletedProcess[str]:
        return _run("ip", "netns", "exec", netns, *cmd)

    def add_host(self, name: str) -> Host:
        """A new namespace with one veth to the bridge and the next address."""
        index = len(self.hosts)
        netns = f"{self.tag}-h{index}"
        address = str(self.subnet.network_address + 10 + index)
        # Interface names are per namespace; the pair is made in the host's
        # namespace and one end moved to the server's, so the root namespace
        # never holds either end.
        self._add_netns(netns)
        self._ns(netns, "ip", "link", "add", "eth0", "type", "veth", "peer", "name",
                 f"v{index}", "netns", self.server_ns)
        self._ns(netns, "ip", "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0")
        self._ns(netns, "ip", "link", "set", "eth0", "up")
        self._ns(self.server_ns, "ip", "link", "set", f"v{index}", "master", "br0")
        self._ns(self.server_ns, "ip", "link", "set", f"v{index}", "up")
        host = Host(name, netns, address)
        self.hosts[name] = host
        return host

    # ------------------------------------------------------------------ processes
    def spawn(self, netns: str, cmd: Sequence[str], **popen: Any) -> subprocess.Popen[Any]:
        """Start ``cmd`` inside ``netns``; it is killed by PID at teardown, and by the
        kernel if this process dies first (start it from the main thread: see
        :mod:`kvstore_tiers.tools.children`)."""
        proc = subprocess.Popen(["ip", "netns", "exec", netns, *cmd],
                                preexec_fn=die_with_parent, **popen)
        self._procs.append(proc)
        return proc

    def adopt(self, proc: subprocess.Popen[Any]) -> None:
        """Stop ``proc`` (started inside one of the namespaces) by PID at teardown."""
        self._procs.append(proc)

    def wait_tcp(self, netns: str, address: str, port: int, timeout_s: float = 30.0) -> None:
        """Wait until ``address:port`` accepts a connection from inside ``netns``."""
        probe = (f"import socket; socket.create_connection(({address!r}, {port}), "
                 "timeout=1).close()")
        deadline = time.monotonic() + timeout_s
        while True:
            done = subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c", probe],
                                  capture_output=True, timeout=30, check=False)
            if done.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address}:{port} not reachable from {netns}: "
                                   f"{done.stderr.decode(errors='replace')[-300:]}")
            time.sleep(0.1)  # polling a server's start-up, not a test condition

    # ------------------------------------------------------------------ partitions
    def _cut_rules(self, host: Host) -> list[tuple[str, list[str]]]:
        return [(self.server_ns, ["INPUT", "-s", host.address, "-j", "DROP"]),
                (host.netns, ["INPUT", "-s", self.server_address, "-j", "DROP"])]

    def cut(self, name: str) -> None:
        """Drop every packet between host ``name`` and the server namespace, both ways."""
        for netns, rule in self._cut_rules(self.hosts[name]):
            self._ns(netns, "iptables", "-w", "-I", *rule)
            self._rules.append((netns, rule))

    def heal(self, name: str) -> None:
        """Delete the rules :meth:`cut` added for host ``name``."""
        for netns, rule in self._cut_rules(self.hosts[name]):
            if (netns, rule) in self._rules:
                self._ns(netns, "iptables", "-w", "-D", *rule)
                self._rules.remove((netns, rule))

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Kill the processes (by PID), delete the rules, then the namespaces."""
        if self._closed:
            return
        self._closed = True
        for proc in self._procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
        for proc in self._procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
        for netns, rule in self._rules:
            _run("ip", "netns", "exec", netns, "iptables", "-w", "-D", *rule, check=False)
        self._rules.clear()
        for netns in reversed(self._namespaces):
            _run("ip", "netns", "del", netns, check=False)
        self._namespaces.clear()
        atexit.unregister(self.close)

    def __enter__(self) -> Fabric:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def namespaces(self) -> list[str]:
        """The namespaces this fabric made and has not deleted yet."""
        return list(self._namespaces)
