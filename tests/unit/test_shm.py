"""Stale vLLM offload regions: real files, real mappings held by child processes."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvstore_tiers import shm
from kvstore_tiers.shm import find_stale_regions, sweep_stale_regions

pytestmark = pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc")

_HOLD = r"""
import ctypes, mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
if sys.argv[2] == "map":
    # libc's mmap, not Python's (which keeps a dup of the fd): after the close
    # only the mapping keeps the file in use, as in a vLLM worker.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    addr = libc.mmap(None, os.fstat(fd).st_size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
    os.close(fd)
print("ready", flush=True)
sys.stdin.read()          # until the parent closes our stdin
"""


def _region(directory: Path, name: str, *, age_s: float = 60.0, size: int = 8192) -> Path:
    path = directory / f"vllm_offload_{name}.mmap"
    with open(path, "wb") as f:
        f.truncate(size)
    past = time.time() - age_s
    os.utime(path, (past, past))
    return path


@pytest.fixture
def holder():
    procs: list[subprocess.Popen] = []

    def hold(path: Path, how: str) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", _HOLD, str(path), how],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"
        procs.append(p)
        return p

    yield hold
    for p in procs:
        p.stdin.close()
        p.wait(timeout=30)


def test_unused_old_region_is_removed_and_logged(tmp_path, caplog):
    stale = _region(tmp_path, "dead-engine")
    other = tmp_path / "unrelated.mmap"
    other.write_bytes(b"x")
    time.sleep(0.3)  # ctime cannot be set: age it past a small min_age instead
    with caplog.at_level(logging.WARNING, logger="kvstore_tiers.shm"):
        freed = sweep_stale_regions(tmp_path, min_age_s=0.2)
    assert freed == 8192
    assert not stale.exists()
    assert other.exists()  # only vllm_offload_*.mmap is ours to judge
    assert str(stale) in caplog.text


def test_mapped_region_is_kept(tmp_path, holder):
    mapped = _region(tmp_path, "live-mapped")
    p = holder(mapped, "map")
    time.sleep(0.3)
    assert find_stale_regions(tmp_path, min_age_s=0.2) == []
    sweep_stale_regions(tmp_path, min_age_s=0.2)
    assert mapped.exists()
    p.stdin.close()
    p.wait(timeout=30)
    time.sleep(0.3)
    # The holder is gone: now nobody maps it.
    assert find_stale_regions(tmp_path, min_age_s=0.2) == [mapped]


def test_open_but_not_mapped_region_is_kept(tmp_path, holder):
    """vLLM's joiners hold the file open while they wait for its size."""
    joined = _region(tmp_path, "being-joined")
    holder(joined, "open")
    time.sleep(0.3)
    assert sweep_stale_regions(tmp_path, min_age_s=0.2) == 0
    assert joined.exists()


def test_young_region_is_kept(tmp_path):
    """A region another engine is creating right now is never removed."""
    young = _region(tmp_path, "creating", age_s=0)
    assert sweep_stale_regions(tmp_path, min_age_s=30) == 0
    assert young.exists()


def test_only_stale_ones_go(tmp_path, holder):
    stale = [_region(tmp_path, f"dead-{i}") for i in range(3)]
    live = _region(tmp_path, "live")
    holder(live, "map")
    time.sleep(0.3)
    assert sweep_stale_regions(tmp_path, min_age_s=0.2) == 3 * 8192
    assert live.exists()
    assert not any(p.exists() for p in stale)


def test_opt_out(tmp_path, monkeypatch):
    stale = _region(tmp_path, "dead")
    time.sleep(0.3)
    monkeypatch.setenv("KVSTORE_TIERS_SWEEP_SHM", "0")
    assert sweep_stale_regions(tmp_path, min_age_s=0.2) == 0
    assert stale.exists()


def test_missing_directory_is_quiet(tmp_path):
    assert sweep_stale_regions(tmp_path / "absent") == 0


def test_the_tiers_of_one_process_sweep_once(tmp_path, monkeypatch, harness_factory):
    """Each /proc scan reads every process's maps: the first tier of a process
    sweeps, its other tiers (and later engines in the process) do not."""
    scans: list[Path] = []

    def counted(directory: Path = shm.SHM_DIR, **kw: Any) -> list[Path]:
        scans.append(directory)
        return find_stale_regions(directory, **kw)

    monkeypatch.setattr(shm, "_swept", False)  # as in a fresh process
    monkeypatch.setattr(shm, "find_stale_regions", counted)
    monkeypatch.delenv("KVSTORE_TIERS_SWEEP_SHM", raising=False)
    harness_factory([{"type": "fs", "root_dir": str(tmp_path / "a")},
                     {"type": "fs", "root_dir": str(tmp_path / "b")}])
    harness_factory([{"type": "fs", "root_dir": str(tmp_path / "c")}])
    assert scans == [shm.SHM_DIR]
