"""Help texts render cleanly; a missing optional package is one line naming the extra."""

from __future__ import annotations

import pytest

from .conftest import invoke, run_without


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
    res = run_without(blocked, *args, cwd=tmp_path)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr
    assert len(lines) == 1 and f"kvstore-tiers[{extra}]" in lines[0], res.stderr
    assert list(tmp_path.iterdir()) == []  # it said so before doing anything
