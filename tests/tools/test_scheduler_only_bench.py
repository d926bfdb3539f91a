"""``bench --scheduler-only``: the fs tiers' scheduler-thread cost, measured alone."""

from __future__ import annotations

import json
from typing import Any

import pytest
from click.testing import CliRunner

from kvstore_tiers.cli.bench import bench
from kvstore_tiers.tools.bench import runner

METHODS = {"submit_store", "submit_load", "lookup", "get_finished_jobs"}


def test_scheduler_only_measures_both_tiers_in_both_gc_phases_and_nothing_else(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    plans: list[runner.BenchPlan] = []
    real_run = runner.run

    def small_run(plan: runner.BenchPlan, progress: Any) -> dict[str, Any]:
        plans.append(plan)
        plan.scheduler_in_flight, plan.reference_mib = 64, 8  # the same steps, fewer chunks
        return real_run(plan, progress)

    monkeypatch.setattr(runner, "run", small_run)
    out = tmp_path / "out"
    r = CliRunner().invoke(bench, ["--scheduler-only", "--dir", str(tmp_path / "b"),
                                   "--out", str(out)])  # plots too
    assert r.exit_code == 0, r.output
    assert len(plans) == 1 and plans[0].chunk_kib == () and plans[0].samples_dir is None
    fs = json.loads((out / "bench.json").read_text())["fs"]
    assert fs["throughput"] == [] and fs["reload"] == [] and fs["disk"] == {}
    assert "compression" not in fs
    for section, waves in (("scheduler", 16), ("scheduler_gc_random_phase", 32)):
        assert set(fs[section]) == {"kvstore", "vllm"}
        for report in fs[section].values():
            assert set(report) == METHODS
            # 64 chunks in jobs of 16 each wave: four store and four load calls.
            for m in ("submit_store", "submit_load"):
                assert report[m]["calls"] == 4 * waves and report[m]["p99_us"] > 0
    assert not (tmp_path / "b").exists()
    assert "scheduler-thread time" in r.output
    assert "GB/s, median of rounds" not in r.output  # no empty throughput table
    assert "real KV samples" not in r.output  # nothing was skipped for want of them
    assert sorted(p.name for p in out.glob("*.png")) == ["bench-scheduler.png"]


@pytest.mark.parametrize("args, says", [
    (["--quick"], "drop --quick"),
    (["--chunk-kib", "2048"], "drop --chunk-kib"),
    (["--redis-url", "redis://127.0.0.1:1/0"], "drop --redis-url"),
    (["--tier", "redis"], "drop --tier"),
    (["--engine"], "--scheduler-only does not apply to"),
    (["--backpressure"], "--scheduler-only does not apply to"),
    (["--load-trace"], "drop --scheduler-only"),
])
def test_scheduler_only_refuses_what_it_does_not_measure(args: list[str], says: str) -> None:
    r = CliRunner().invoke(bench, ["--scheduler-only", *args])
    assert r.exit_code == 2 and says in r.output, r.output
