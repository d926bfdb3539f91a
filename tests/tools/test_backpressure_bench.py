"""``bench --backpressure`` runs both arms through vLLM's manager and writes bench.json."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from kvstore_tiers.cli import main


def test_backpressure_bench_runs_both_arms(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["bench", "--backpressure", "--pairs", "1", "--rounds",
                                       "6", "--dir", str(tmp_path / "d"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "bench.json").read_text())
    assert [r["arm"] for r in doc["runs"]] == ["bounded", "unbounded"]
    summary = doc["summary"]
    assert summary["unbounded"]["dropped_backpressure"] == 0
    for arm in summary.values():
        assert arm["wrong_bytes"] == 0
    # With the bound, stores never pin the rows the reader's promotions need.
    assert summary["bounded"]["hit_share"] == 1.0
    assert summary["bounded"]["refused_by_primary"] == 0


def test_backpressure_refuses_options_of_other_modes(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["bench", "--backpressure", "--tier", "redis"])
    assert result.exit_code == 2 and "--backpressure runs its own workload" in result.output
