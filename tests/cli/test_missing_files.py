"""A file or directory the user does not have fails in one line naming the option and the path.

The docs name data a user fetches first (the Mooncake trace, real KV samples,
a ``tiers.json``); a command given a path that is not there must say which
option and which path, before doing any work, never with a traceback.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import invoke


@pytest.mark.parametrize(("args", "option"), [
    (("bench", "--trace", "traces/mooncake-conversation.jsonl", "--requests", "10"), "--trace"),
    (("bench", "--tier", "fs", "--samples", "kv-samples"), "--samples"),
    (("demo", "--config", "tiers.json"), "--config"),
    (("stats", "--config", "tiers.json"), "--config"),
], ids=["bench-trace", "bench-samples", "demo-config", "stats-config"])
def test_a_missing_path_names_the_option_and_the_path(args: tuple[str, ...], option: str,
                                                     tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    out = invoke(*args)
    path = args[args.index(option) + 1]
    assert out.exit_code == 2, out.output
    error = out.output.strip().splitlines()[-1]
    assert error.startswith("Error: Invalid value for") and option in error, error
    assert path.rsplit("/", 1)[-1] in error, error
    assert list(tmp_path.iterdir()) == []  # refused before any work


def test_the_trace_design_tool_names_a_missing_trace(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from kvstore_tiers.tools.bench import trace_design

    missing = tmp_path / "mooncake-conversation.jsonl"
    with pytest.raises(SystemExit) as exc:
        trace_design.main([str(missing), "--requests", "10"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert f"argument trace: {missing} is not a file" in err
    assert "Traceback" not in err
