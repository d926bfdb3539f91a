"""A virtual environment holding kvstore-tiers and its core dependencies only: no extra.

A plain venv (no system site-packages, no pip), whose site-packages links this
checkout's ``kvstore_tiers`` and every distribution that ``[project]
dependencies`` of pyproject.toml pulls in, transitively, from the test's own
environment (links, not installs: no network, a fraction of a second). A
command that imports an extra's package by mistake (redis, boto3, vLLM, ...)
fails there as it would on a user's ``pip install kvstore-tiers``.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.doc_commands import REPO


def core_distributions() -> list[md.Distribution]:
    """The installed distributions that the core dependencies need, transitively."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    todo = [Requirement(r) for r in project["dependencies"]]
    seen: dict[str, md.Distribution] = {}
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        seen[name] = dist = md.distribution(req.name)
        todo += [Requirement(r) for r in dist.requires or ()]
    return list(seen.values())


def _site_packages(venv: Path) -> Path:
    v = sys.version_info
    return venv / "lib" / f"python{v.major}.{v.minor}" / "site-packages"


def make_core_venv(venv: Path) -> Path:
    """Create the venv at ``venv``; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    site = _site_packages(venv)
    (site / "kvstore_tiers").symlink_to(REPO / "kvstore_tiers")
    for dist in core_distributions():
        base = Path(str(dist.locate_file("")))
        tops = {Path(str(f)).parts[0] for f in dist.files or ()
                if not str(f).startswith("..") and Path(str(f)).parts[0] != "bin"}
        for top in tops:
            target = site / top
            if (base / top).exists() and not target.exists():
                target.symlink_to(base / top)
    return venv / "bin" / "python"


def run_cli(python: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``kvstore-tiers <args>`` with ``python`` (a core venv's), nothing of ours on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(python), "-c", "from kvstore_tiers.cli import main; main()",
                           *args], capture_output=True, text=True, timeout=120, cwd=cwd,
                          env={**env, "PYTHONNOUSERSITE": "1"})
