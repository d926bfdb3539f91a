"""``kvstore-tiers bench --engine``: its options, and one real pair of engine runs."""

from __future__ import annotations

import json
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
    (["--engine", "--tier", "redis"], "--engine runs its own workload; drop --tiers"),
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


@pytest.mark.engine
def test_one_pair_of_real_engine_runs(tmp_path: Path) -> None:
    """Tiny random-weight model, the demo's prompts: five engine processes."""
    pytest.importorskip("vllm")
    out = tmp_path / "out"
    result = invoke("--engine", "--pairs", "1", "--model", "tiny",
                    "--dir", str(tmp_path / "scratch"), "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "stock / ours" in result.output
    assert not (tmp_path / "scratch").exists()  # every run's directory removed
    data = json.loads((out / "bench.json").read_text())
    engine = data["engine"]
    assert engine["summary"]["valid_pairs"] == 1 and engine["summary"]["failed"] == []
    runs = {r["arm"]: r for r in engine["runs"]}
    assert [r["arm"] for r in engine["runs"]] == ["ours", "stock", "recompute"]
    assert runs["ours"]["tier_class"].startswith("kvstore_tiers.")
    assert runs["stock"]["tier_class"].startswith("vllm.")
    for arm in ("ours", "stock"):
        cold, warm = runs[arm]["cold"], runs[arm]["warm"]
        assert sum(cold["external_hit_tokens"]) == 0 and cold["tier_write_bytes"] > 0
        # prompt 1 of the fresh engine: its whole prefix (17 full chunks) from the tier
        assert warm["external_hit_tokens"][0] == 17 * 128
        assert warm["tier_read_bytes"] > 0
        assert warm["outputs"] == runs["recompute"]["warm"]["outputs"]
    assert "recompute" not in engine["summary"]["speedup_vs_recompute"]
    assert data["code"]["path"]
    logged = [json.loads(line) for line in (out / "engine-runs" / "runs.jsonl").open()]
    assert logged == engine["runs"]
