"""``kvstore-tiers bench --engine``: its options (one real pair of engine runs:
tests/e2e/test_engine_bench_e2e.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner, Result


def invoke(*args: str) -> Result:
    from kvstore_tiers.cli import main

    return CliRunner().invoke(main, ["bench", *args])


def test_help_lists_the_engine_options() -> None:
    out = invoke("--help").output
    for option in ("--engine", "--pairs", "--model", "--single-process / --multi-process"):
        assert option in out


@pytest.mark.parametrize("args, message", [
    (["--pairs", "3"], "--pairs only apply to --engine"),
    (["--model", "tiny", "--tier", "fs"], "--model only apply to --engine"),
    (["--multi-process"], "--single-process only apply to --engine"),
    (["--engine", "--tier", "fs"], "--engine runs its own workload; drop --tier"),
    (["--engine", "--quick", "--rounds", "4"], "drop --quick, --rounds"),
])
def test_options_that_do_not_go_together_are_refused(args: list[str], message: str,
                                                     tmp_path: Path) -> None:
    result = invoke(*args, "--dir", str(tmp_path / "d"), "--out", str(tmp_path / "o"))
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not (tmp_path / "o").exists()  # nothing ran


def test_pairs_must_be_positive(tmp_path: Path) -> None:
    result = invoke("--engine", "--pairs", "0", "--out", str(tmp_path / "o"))
    assert result.exit_code == 2 and "--pairs" in result.output
