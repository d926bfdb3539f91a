"""``kvstore-tiers bench --engine --tier s3|redis``: its options, its order of runs and the
summary's arithmetic (a real round of engines: tests/e2e/test_engine_bench_e2e.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from kvstore_tiers.tools.bench import engine_distance as ed

BLOCK = 128
PROMPT = 2200  # 17 full blocks: 2176 tokens from the tier


def invoke(*args: str) -> Result:
    from kvstore_tiers.cli import main

    return CliRunner().invoke(main, ["bench", *args])


def run(round_: int, rtt: float | None, ttft: float, wait: float | None = None,
        hits: int = 17 * BLOCK, output: list[int] | None = None,
        error: str | None = None) -> dict[str, Any]:
    return {"tier": "s3", "round": round_, "rtt_ms": rtt, "error": error, "ttft_s": ttft,
            "queued_s": wait, "prefill_s": 0.01, "prompt_tokens": PROMPT,
            "external_hit_tokens": 0 if rtt is None else hits, "output": output or [1, 2, 3]}


def test_extra_rtts_are_paired_within_a_round_then_the_median() -> None:
    runs = []
    # round 0: 50 ms added 100 ms (2 RTTs); round 1: 200 ms (4 RTTs); round 2: 150 ms (3)
    for r, (base, far) in enumerate([(0.30, 0.40), (0.50, 0.70), (0.20, 0.35)]):
        runs += [run(r, 0.0, base, base - 0.01), run(r, 50.0, far, far - 0.02),
                 run(r, None, 1.0)]
    s = ed.summarize(runs, (0.0, 50.0), BLOCK, target=2)
    assert (s["rounds"], s["valid_rounds"], s["failed"]) == (3, 3, [])
    zero, far = s["cells"]
    assert zero["extra_rtts"] is None and zero["within_target"] is None
    assert far["extra_rtts"] == pytest.approx(3.0)  # median of 2, 4, 3
    assert far["extra_rtts_wait"] == pytest.approx(2.8)  # median of 1.8, 3.8, 2.8
    assert far["within_target"] is False
    assert ed.summarize(runs, (0.0, 50.0), BLOCK, target=4)["cells"][1]["within_target"]
    # to a tenth: 2.04 RTTs meets a target of 2 (what the table shows as 2.0)
    near = [run(0, 0.0, 0.3), run(0, 50.0, 0.402), run(0, None, 1.0)]
    assert ed.summarize(near, (0.0, 50.0), BLOCK, target=2)["cells"][1]["within_target"]
    assert far["ttft_ms"] == pytest.approx(400.0) and zero["ttft_ms"] == pytest.approx(300.0)
    assert s["recompute_ttft_ms"] == pytest.approx(1000.0)
    # recompute / TTFT per round: 2.5, 1.43, 2.86 -> 2.5
    assert far["recompute_over_ttft"] == pytest.approx(2.5)


def test_a_failed_run_leaves_the_figures_and_says_why() -> None:
    runs = [run(0, 0.0, 0.3), run(0, 20.0, 0.33), run(0, None, 1.0),
            # round 1: the far engine got 3 blocks from the tier; its output differs too
            run(1, 0.0, 0.3), run(1, 20.0, 0.9, hits=3 * BLOCK, output=[9]),
            run(1, None, 1.0),
            # round 2: the recompute engine failed: nothing to compare outputs with
            run(2, 0.0, 0.3), run(2, 20.0, 0.5), run(2, None, 0.0, error="boom")]
    s = ed.summarize(runs, (0.0, 20.0), BLOCK, target=2)
    assert s["valid_rounds"] == 1
    why = {(f["round"], f["rtt_ms"]): f["reasons"] for f in s["failed"]}
    assert why[(1, 20.0)] == ["384 of 2176 prompt tokens from the tier",
                              "output differs from recompute"]
    assert why[(2, None)] == ["engine failed: boom"]
    assert why[(2, 20.0)] == ["no recompute run in this round to compare the output with"]
    far = s["cells"][1]
    assert far["runs"] == 1 and far["extra_rtts"] == pytest.approx(1.5)
    assert far["within_target"] is True
    rendered = ed.table({"plan": {"model": "tiny"}, "tiers": {"s3": {
        "server": "moto_server (local)", "closes_connections": True, "summary": s}}})
    assert len(rendered) == 2  # the cells, then the failed runs


def test_the_order_of_runs_is_reversed_every_other_round() -> None:
    cells = [0.0, 20.0, 50.0, None]
    assert ed.cell_order(cells, 0) == cells
    assert ed.cell_order(cells, 1) == [None, 50.0, 20.0, 0.0]


def test_rtt_zero_is_always_measured_first() -> None:
    plan = ed.EngineDistancePlan(tiers=("s3", "redis"))
    assert plan.rtts_for("s3") == (0.0, 20.0, 50.0)
    assert plan.rtts_for("redis") == (0.0, 1.0, 5.0)
    plan.rtts_ms = (50.0, 5.0)
    assert plan.rtts_for("redis") == (0.0, 5.0, 50.0)
    # fill and, per RTT and recompute, one engine each round
    plan.rounds = 2
    assert ed.phase_count(plan) == 2 * 2 * (3 + 2)
    assert ed.prompt_blocks(plan) == 17


def test_engines_run_their_core_in_its_own_process_as_vllm_serve_does() -> None:
    # In-process, vLLM's engine loop never pauses while the prompt waits for the
    # tier, and the tier's I/O threads measure the GIL instead of the distance.
    plan = ed.EngineDistancePlan()
    assert plan.single_process is False
    assert ed._spec(plan, "rtt0", "model", None).single_process is False


def test_help_names_the_engine_distance_shape() -> None:
    out = invoke("--help").output
    assert "--engine --tier s3 --rtt-ms 20 --rtt-ms 50 --rounds 3" in out


@pytest.mark.parametrize("args, message", [
    (["--engine", "--tier", "s3", "--pairs", "2"],
     "--engine with --tier s3 or redis runs its own workload; drop --pairs"),
    (["--engine", "--tier", "redis", "--cap-mbit", "100"], "drop --cap-mbit"),
    (["--engine", "--tier", "s3", "--tier", "fs"], "give --tier s3 and/or redis alone"),
    (["--engine", "--tier", "redis", "--tier-key", "nope=1"], "redis has no config key 'nope'"),
    (["--rtt-ms", "5"], "--rtt-ms only apply to --distance (or to --engine with --tier s3"),
    (["--engine", "--rtt-ms", "5"], "--rtt-ms only apply to --distance"),
])
def test_options_that_do_not_go_together_are_refused(args: list[str], message: str,
                                                     tmp_path: Path) -> None:
    result = invoke(*args, "--out", str(tmp_path / "o"))
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert not (tmp_path / "o").exists()  # nothing ran
