"""The fabric of tests/netns.py: a cut drops one host's packets only, a heal lets them
through, and teardown leaves nothing behind even when the test fails."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.netns import PREFIX, Fabric, require_netns
from tests.orphans import children_die_with_parent


def _connects(fabric: Fabric, netns: str, port: int) -> bool:
    """Does a TCP connect from ``netns`` to the server address succeed within 1 s?"""
    probe = (f"import socket; socket.create_connection(({fabric.server_address!r}, {port}), "
             "timeout=1).close()")
    done = subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c", probe],
                          capture_output=True, timeout=30, check=False)
    return done.returncode == 0


def test_a_cut_drops_one_hosts_packets_and_a_heal_lets_them_through(fabric: Fabric) -> None:
    a, b = fabric.add_host("a"), fabric.add_host("b")
    listen = ("import socket, sys; s = socket.create_server((sys.argv[1], 7000)); "
              "[s.accept()[0].close() for _ in iter(int, 1)]")
    fabric.spawn(fabric.server_ns, [sys.executable, "-c", listen, fabric.server_address])
    fabric.wait_tcp(a.netns, fabric.server_address, 7000)
    assert _connects(fabric, a.netns, 7000) and _connects(fabric, b.netns, 7000)
    fabric.cut("a")
    assert not _connects(fabric, a.netns, 7000)
    assert _connects(fabric, b.netns, 7000)
    fabric.heal("a")
    assert _connects(fabric, a.netns, 7000)


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def test_teardown_kills_its_processes_and_deletes_its_namespaces_when_the_test_fails() -> None:
    require_netns()
    with pytest.raises(RuntimeError, match="the test failed"), Fabric() as fabric:
        fabric.add_host("a")
        made = set(fabric.namespaces())
        proc = fabric.spawn(fabric.server_ns, ["sleep", "600"])
        fabric.cut("a")
        raise RuntimeError("the test failed")
    assert proc.poll() is not None  # killed by its PID
    assert not made & _namespaces()  # namespaces gone: their veths, bridge and rules too
    assert fabric.namespaces() == []


def test_a_sigkilled_test_process_leaves_no_process_and_its_namespaces_are_swept() -> None:
    """Killed by SIGKILL, the test process runs no teardown: the kernel kills what it
    spawned in its namespaces (PR_SET_PDEATHSIG), and the next fabric deletes the
    namespaces it left, which carry its PID."""
    require_netns()
    pid, children = children_die_with_parent(
        "from tests.netns import Fabric\n"
        "f = Fabric()\n"
        "h = f.add_host('a')\n"
        "f.spawn(f.server_ns, ['sleep', '600'])\n"
        "f.spawn(h.netns, ['sleep', '600'])\n")
    assert len(children) == 2
    left = {ns for ns in _namespaces() if ns.startswith(f"{PREFIX}{pid}-")}
    assert len(left) == 2  # the server's and the host's: nothing deleted them
    with Fabric() as fabric:
        assert not left & _namespaces()
        assert fabric.namespaces() == [fabric.server_ns]
