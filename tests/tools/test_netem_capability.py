"""kvstore_tiers.tools.netem.capability: the one check of whether namespaces, veth,
netfilter and tc can be used, and the reason when they cannot."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from kvstore_tiers.tools.netem import capability

#: /proc/self/status of a root shell in a container that keeps its default
#: capabilities: CAP_SYS_ADMIN (bit 21) and CAP_NET_ADMIN (bit 12) are not among them.
DOCKER_DEFAULT = "Name:\tbash\nUid:\t0\t0\t0\t0\nCapEff:\t00000000a80425fb\n"
ALL = "CapEff:\t000001ffffffffff\n"
TOOLS = {tool: f"/usr/sbin/{tool}" for tool in capability.TOOLS}


def test_an_effective_set_lacking_the_bits_names_them() -> None:
    assert capability.missing_caps(DOCKER_DEFAULT) == ["CAP_NET_ADMIN", "CAP_SYS_ADMIN"]
    only_sys_admin = f"CapEff:\t{1 << 21:016x}\n"
    assert capability.missing_caps(only_sys_admin) == ["CAP_NET_ADMIN"]
    assert capability.missing_caps(ALL) == []
    assert capability.missing_caps("Name:\tx\n") == ["CAP_NET_ADMIN", "CAP_SYS_ADMIN"]


def test_the_reason_names_what_is_missing_first() -> None:
    why = capability.why_unavailable(DOCKER_DEFAULT, True, TOOLS)
    assert why is not None and "CAP_NET_ADMIN and CAP_SYS_ADMIN" in why  # uid 0 or not
    assert "network namespaces" in str(capability.why_unavailable(ALL, False, TOOLS))
    why = capability.why_unavailable(ALL, True, {**TOOLS, "tc": None, "iptables": None})
    assert why == "tc, iptables not found (apt-get install iproute2 iptables)"
    assert capability.why_unavailable(ALL, True, TOOLS) is None


def test_a_root_process_without_cap_net_admin_is_told_so() -> None:
    """The answer follows the capability, not the uid: root with CAP_NET_ADMIN taken
    out of its bounding and inheritable sets (setpriv) gets the reason naming it."""
    if capability.unavailable() is not None:
        pytest.skip(capability.unavailable())
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv not found (apt-get install util-linux)")
    ask = ("from kvstore_tiers.tools.netem import capability; "
           "print(capability.unavailable())")
    out = subprocess.run(["setpriv", "--bounding-set", "-net_admin", "--inh-caps", "-net_admin",
                          sys.executable, "-c", ask],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert "lacks CAP_NET_ADMIN in its effective capabilities" in out, out


def test_here_the_probe_agrees_with_the_capabilities() -> None:
    """Where the effective set has both bits and the tools are there, the answer is
    the probe's: a namespace with a veth pair, a qdisc and a rule was made and removed."""
    with open("/proc/self/status") as f:
        status = f.read()
    pre = capability.why_unavailable(status, True, {t: shutil.which(t) for t in TOOLS})
    if pre is not None:
        assert capability.unavailable() == pre
        return
    assert capability.unavailable() is None
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"{capability.PROBE_PREFIX}{os.getpid()}-" not in left
