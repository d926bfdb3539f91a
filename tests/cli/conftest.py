"""Fixtures of the command-line tests: a populated fs store and a CLI runner (the real
redis-server / moto S3 fixtures come from tests/servers.py through tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner, Result

ROW = 16 << 10  # bytes per block in these tests: small, so every test stays fast


def invoke(*args: str) -> Result:
    """Run ``kvstore-tiers <args>`` in-process; exceptions other than SystemExit propagate."""
    from kvstore_tiers.cli import main

    return CliRunner().invoke(main, list(args), catch_exceptions=False)


#: A child that runs the CLI as if ``blocked`` (top-level modules) were not installed.
_BLOCKED_CLI = """
import sys
blocked = set(sys.argv[1].split(","))
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Blocker())
from kvstore_tiers.cli import main
sys.argv = ["kvstore-tiers", *sys.argv[2:]]
main()
"""


def run_without(blocked: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``kvstore-tiers <args>`` in a child that cannot import the comma-separated
    top-level modules ``blocked`` (as if their extra were not installed)."""
    return subprocess.run([sys.executable, "-c", _BLOCKED_CLI, blocked, *args],
                          capture_output=True, text=True, timeout=120, cwd=cwd,
                          env={**os.environ, "AWS_ACCESS_KEY_ID": "x",
                               "AWS_SECRET_ACCESS_KEY": "y"})


def populate(harness_factory: Callable[..., Any], tier: dict[str, Any], n: int = 8,
             seed: int = 0, **kw: Any) -> list[bytes]:
    """Store ``n`` random blocks through vLLM's real manager; returns their keys."""
    from kvstore_tiers.admin.harness import make_keys

    h = harness_factory([tier], num_chunks=n, chunk_bytes=ROW, **kw)
    keys = make_keys(n, seed=seed)
    rows = np.random.default_rng(seed).integers(0, 256, (n, ROW), dtype=np.uint8)
    h.store_all(keys, rows)
    assert h.tiers[0].counters.objects_stored == n
    return keys


def kvf_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kvf"))


def flip_byte(path: Path, offset_from_end: int = 100) -> None:
    """Corrupt one payload byte of a stored object in place."""
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0xFF
    path.write_bytes(bytes(data))


def age(path: Path, seconds: float) -> None:
    """Make an object look ``seconds`` old (fs ages are mtimes)."""
    st = path.stat()
    os.utime(path, (st.st_atime - seconds, st.st_mtime - seconds))


@pytest.fixture
def fs_store(tmp_path: Path, harness_factory: Callable[..., Any]) -> Path:
    """An fs store holding 8 blocks of one namespace."""
    root = tmp_path / "store"
    populate(harness_factory, {"type": "fs", "root_dir": str(root)})
    return root
