"""``kvstore-tiers bench --engine`` for real: one pair of engine runs (five engine processes),
and one round of a fresh engine at distance from redis (four).

Here, not in tests/tools, because the engine runs need vLLM's CPU build,
which the vLLM 0.33 pass (everything but tests/e2e) does not have."""

from __future__ import annotations

import json
import shutil
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


@pytest.mark.engine
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")
def test_a_fresh_engine_at_distance_from_redis(tmp_path: Path) -> None:
    """One round on its own redis-server: fill, RTT 0 and 1 ms, recompute (four engines)."""
    from kvstore_tiers.cli import main

    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["bench", "--engine", "--tier", "redis", "--rtt-ms", "1",
                                       "--rounds", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "+ RTTs (TTFT)" in result.output
    doc = json.loads((out / "engine-distance.json").read_text())
    res = doc["tiers"]["redis"]
    s = res["summary"]
    assert (s["valid_rounds"], s["failed"], s["target_rtts"]) == (1, [], 2)
    assert [c["rtt_ms"] for c in s["cells"]] == [0.0, 1.0]
    assert s["cells"][0]["extra_rtts"] is None and s["cells"][1]["extra_rtts"] is not None
    runs = {r["rtt_ms"]: r for r in res["runs"]}
    for rtt in (0.0, 1.0):
        # every full block of the prompt from the tier, in a process that stored none
        assert runs[rtt]["external_hit_tokens"] == 17 * 128
        assert runs[rtt]["output"] == runs[None]["output"]
    assert runs[None]["external_hit_tokens"] == 0
    logged = [json.loads(line) for line in (out / "engine-distance-runs" / "runs.jsonl").open()]
    assert [r["cell"] for r in logged if "cell" in r] == ["fill"]
    assert len(logged) == 4
