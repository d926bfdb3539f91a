"""``kvstore-tiers bench --engine`` for real: one pair of engine runs (five engine processes).

Here, not in tests/tools, because the engine runs need vLLM's CPU build,
which the vLLM 0.33 pass (everything but tests/e2e) does not have."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner


@pytest.mark.engine
def test_one_pair_of_real_engine_runs(tmp_path: Path) -> None:
    """Tiny random-weight model, the demo's prompts: five engine processes."""
    from kvstore_tiers.cli import main

    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["bench", "--engine", "--pairs", "1", "--model", "tiny",
                                       "--dir", str(tmp_path / "scratch"), "--out", str(out)])
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
        # vLLM's timestamps split each TTFT: the wait for the tier, then the forward pass
        assert all(q > 0 for q in warm["queued_s"]) and all(f > 0 for f in warm["prefill_s"])
    assert engine["summary"]["warm_split"]["stock_over_ours_wait"]["ratio"] > 0
    assert "recompute" not in engine["summary"]["speedup_vs_recompute"]
    assert data["code"]["path"]
    logged = [json.loads(line) for line in (out / "engine-runs" / "runs.jsonl").open()]
    assert logged == engine["runs"]
