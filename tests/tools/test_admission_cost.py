"""The admission A/B of scheduler-thread cost (kvstore_tiers.tools.bench.admission_cost)."""

from __future__ import annotations

import math
from pathlib import Path

from kvstore_tiers.tools.bench import admission_cost


def _ratios(summary: dict, method: str, figure: str) -> dict[str, list[float]]:
    return {arm: summary[method][arm][figure] for arm in ("reuse", "adaptive")
            if figure in summary[method][arm]}


def test_each_arm_gets_ratios_to_always_of_the_same_rounds(tmp_path: Path) -> None:
    out = admission_cost.run(tmp_path, rounds=2, chunk=4096, in_flight=32, waves=2)
    s = out["summary"]
    assert out["sighted"] and set(s) == {*admission_cost.METHODS, "all"}
    for method in admission_cost.METHODS:
        for arm in ("always", "reuse", "adaptive"):
            assert s[method][arm]["p50_us"] > 0 and s[method][arm]["total_us"] > 0
    for figure in ("p50_ratio", "p99_ratio"):
        ratios = _ratios(s, "submit_store", figure)
        assert set(ratios) == {"reuse", "adaptive"}
        for ratio, lo, hi in ratios.values():
            assert 0 < lo <= ratio <= hi
    assert set(_ratios(s, "all", "total_ratio")) == {"reuse", "adaptive"}
    assert all(len(out["raw"][arm]) == 2 for arm in admission_cost.ARMS)


def test_unseen_runs_stores_only_and_makes_no_ratio_of_no_calls(tmp_path: Path
                                                                       ) -> None:
    out = admission_cost.run(tmp_path, rounds=1, chunk=4096, in_flight=32, waves=2,
                             sighted=False)
    s = out["summary"]
    # Stores only: no arm makes a submit_load call, and no ratio is made of none.
    for arm in admission_cost.ARMS:
        assert math.isnan(s["submit_load"][arm]["p50_us"])
        assert "p50_ratio" not in s["submit_load"][arm]
    assert s["submit_store"]["reuse"]["p50_ratio"][0] > 0
    assert s["all"]["reuse"]["total_ratio"][0] > 0
