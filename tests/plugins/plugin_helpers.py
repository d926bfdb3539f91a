"""Install the kvstore-memory plugin into a throw-away directory and run children.

The shared venv is never modified: the plugin is copied to a temp dir (pip
writes ``*.egg-info`` next to the sources it builds, and other engineers use
this tree concurrently), installed with ``pip install --no-deps --target``,
and only child processes that get that directory on ``PYTHONPATH`` see it.
``importlib.metadata`` reads entry points from every ``sys.path`` entry, so
that is all a plugin needs to be found.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PLUGIN_SRC = REPO / "plugins" / "kvstore-memory"
CHILD = Path(__file__).resolve().parent / "child_memory_tier.py"
RESULT_PREFIX = "RESULT "


def load_backend_module() -> ModuleType:
    """The plugin's backend module, imported from its source file.

    Not through ``sys.path``: that would also expose the plugin's entry point
    to the rest of this pytest session and change what other tests see as
    "installed". Imported once per process."""
    name = "_kvstore_memory_backend_under_test"
    if name in sys.modules:
        return sys.modules[name]
    path = PLUGIN_SRC / "kvstore_memory" / "backend.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # pydantic resolves annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def install_plugin(dest: Path) -> Path:
    """``pip install --no-deps --target`` the plugin into ``dest/site``; return that."""
    src = dest / "src"
    shutil.copytree(PLUGIN_SRC, src, ignore=shutil.ignore_patterns("*.egg-info", "__pycache__",
                                                                  "build"))
    site = dest / "site"
    # --no-build-isolation: build with the venv's setuptools instead of
    # fetching one from an index (no network needed, ~4 s instead of ~20).
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "--target", str(site), str(src)],
        check=True, capture_output=True, text=True, timeout=300,
    )
    return site


def child_env(pythonpath: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return env


def run_child(scenario: str, pythonpath: Path | None, timeout_s: float = 240) -> dict[str, Any]:
    """Run one scenario of child_memory_tier.py; return its JSON result."""
    proc = subprocess.run(
        [sys.executable, str(CHILD), scenario], env=child_env(pythonpath),
        capture_output=True, text=True, timeout=timeout_s, cwd=str(REPO),
    )
    return parse_result(proc, scenario)


def parse_result(proc: subprocess.CompletedProcess[str], what: str) -> dict[str, Any]:
    """The child's ``RESULT {json}`` line; fail with its output if it has none."""
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise AssertionError(
            f"child {what!r} failed (exit {proc.returncode})\n"
            f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"
        )
    return json.loads(lines[-1][len(RESULT_PREFIX):])
