"""Help texts render cleanly; a missing optional package is one line naming the extra."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from .conftest import invoke

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


def _commands() -> list[str]:
    from kvstore_tiers.cli import main

    return main.list_commands(None)  # type: ignore[arg-type]


def test_every_help_text_renders_without_printf_escapes() -> None:
    assert {"check", "gc", "lifecycle", "stats", "verify", "bench", "demo"} <= set(_commands())
    top = invoke("--help")
    assert top.exit_code == 0 and "%%" not in top.output
    for cmd in _commands():
        out = invoke(cmd, "--help")
        assert out.exit_code == 0, (cmd, out.output)
        assert "%%" not in out.output, cmd


def _run_without(blocked: str, *args: str, tmp_path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _BLOCKED_CLI, blocked, *args],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "AWS_ACCESS_KEY_ID": "x",
                               "AWS_SECRET_ACCESS_KEY": "y"})


@pytest.mark.parametrize(("blocked", "args", "extra"), [
    ("vllm", ("check", "--fs", "kv"), "vllm"),
    ("torch", ("check", "--fs", "kv"), "vllm"),
    ("vllm", ("bench", "--quick", "--no-plots"), "vllm"),
    ("torch", ("demo",), "vllm"),
    ("boto3", ("stats", "--s3", "kv-cache", "--endpoint-url", "http://127.0.0.1:9"), "s3"),
    ("redis", ("stats", "--redis", "redis://127.0.0.1:9/0"), "redis"),
], ids=["check-vllm", "check-torch", "bench-vllm", "demo-torch", "stats-s3", "stats-redis"])
def test_a_missing_extra_is_one_line(blocked: str, args: tuple[str, ...], extra: str,
                                     tmp_path) -> None:
    res = _run_without(blocked, *args, tmp_path=tmp_path)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr
    assert len(lines) == 1 and f"kvstore-tiers[{extra}]" in lines[0], res.stderr
    assert list(tmp_path.iterdir()) == []  # it said so before doing anything
