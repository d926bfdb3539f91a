"""``bench --scheduler-only``: the fs tiers' scheduler-thread cost, measured alone."""

from __future__ import annotations

import io

from click.testing import CliRunner
from rich.console import Console

from kvstore_tiers.cli.bench import bench
from kvstore_tiers.tools.bench.runner import BenchPlan, run
from kvstore_tiers.tools.bench.tables import print_tables

METHODS = {"submit_store", "submit_load", "lookup", "get_finished_jobs"}


def test_scheduler_only_measures_both_tiers_in_both_gc_phases_and_nothing_else(tmp_path) -> None:
    plan = BenchPlan(scheduler_only=True, scheduler_in_flight=64, directory=tmp_path / "b")
    result = run(plan, progress=lambda _msg: None)
    fs = result["fs"]
    assert fs["throughput"] == [] and fs["reload"] == [] and fs["disk"] == {}
    assert "compression" not in fs
    for section in ("scheduler", "scheduler_gc_random_phase"):
        assert set(fs[section]) == {"kvstore", "vllm"}
        for report in fs[section].values():
            assert set(report) == METHODS
            # 64 chunks in jobs of 16, 16 waves (32 with the phase drawn): one
            # store and one load call per job and wave.
            waves = 16 if section == "scheduler" else 32
            for m in ("submit_store", "submit_load"):
                assert report[m]["calls"] == 4 * waves and report[m]["p99_us"] > 0
    assert not (tmp_path / "b").exists()
    out = io.StringIO()
    print_tables(result, Console(file=out, width=200))
    assert "scheduler-thread time" in out.getvalue()
    assert "GB/s, median of rounds" not in out.getvalue()  # no empty throughput table


def test_scheduler_only_refuses_what_it_does_not_measure() -> None:
    r = CliRunner().invoke(bench, ["--scheduler-only", "--quick"])
    assert r.exit_code == 2 and "drop --quick" in r.output
    r = CliRunner().invoke(bench, ["--scheduler-only", "--tier", "redis"])
    assert r.exit_code == 2 and "drop --tier" in r.output
    r = CliRunner().invoke(bench, ["--scheduler-only", "--engine"])
    assert r.exit_code == 2 and "--scheduler-only does not apply to" in r.output
