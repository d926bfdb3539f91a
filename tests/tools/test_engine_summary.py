"""The engine benchmark's figures from given runs (kvstore_tiers.tools.bench.engine_summary)."""

from __future__ import annotations

import math
import statistics
from typing import Any

import pytest

from kvstore_tiers.tools.bench.engine_bench import run_order
from kvstore_tiers.tools.bench.engine_summary import summarize

OUT = [[1, 2, 3], [4, 5, 6]]


def _phase(ttft: list[float], outputs: list[list[int]] = OUT, hits: int = 256
           ) -> dict[str, Any]:
    return {"ttft_s": ttft, "outputs": [list(o) for o in outputs],
            "external_hit_tokens": [hits] + [0] * (len(ttft) - 1)}


def _pair(pair: int, ours: list[float], stock: list[float], recompute: list[float],
          cold: list[float] | None = None) -> list[dict[str, Any]]:
    cold = cold or [2.0, 1.0]
    runs = []
    for position, arm in enumerate(run_order(pair)):
        run: dict[str, Any] = {"pair": pair, "position": position, "arm": arm, "error": None}
        if arm == "recompute":
            run["warm"] = _phase(recompute, hits=0)
        else:
            run["tier_ok"] = True
            run["cold"] = _phase(cold, hits=0)
            run["warm"] = _phase(ours if arm == "ours" else stock)
        runs.append(run)
    return runs


def test_the_order_is_reversed_every_pair() -> None:
    assert run_order(0) == ["ours", "stock", "recompute"]
    assert run_order(1) == ["recompute", "stock", "ours"]
    assert run_order(2) == run_order(0)


def test_ratios_are_geometric_means_over_pairs_with_a_t_interval() -> None:
    # Warm TTFT (first, second prompt), seconds. Stock is 2x, 1.5x, 2.5x ours over
    # the two prompts' mean; recompute 10x ours.
    pairs = [([0.3, 0.1], [0.6, 0.2], [3.0, 1.0]),
             ([0.4, 0.2], [0.7, 0.2], [6.0, 6.0]),
             ([0.2, 0.2], [0.8, 0.2], [3.0, 1.0])]
    runs = [r for i, (o, s, c) in enumerate(pairs) for r in _pair(i, o, s, c)]
    out = summarize(runs)
    assert out["pairs"] == 3 and out["valid_pairs"] == 3 and out["failed"] == []
    per_pair = [statistics.fmean(s) / statistics.fmean(o) for o, s, _ in pairs]
    assert per_pair == pytest.approx([2.0, 1.5, 2.5])
    mean = out["stock_over_ours"]["mean"]
    assert mean["pairs"] == pytest.approx(per_pair, abs=1e-4)
    logs = [math.log(r) for r in per_pair]
    assert mean["ratio"] == pytest.approx(math.exp(statistics.fmean(logs)))
    half = 4.303 * statistics.stdev(logs) / math.sqrt(3)  # t, 2 degrees of freedom
    assert mean["ci95"] == pytest.approx([mean["ratio"] * math.exp(-half),
                                          mean["ratio"] * math.exp(half)], rel=1e-3)
    first = out["stock_over_ours"]["first"]
    assert first["pairs"] == pytest.approx([2.0, 1.75, 4.0])
    # recompute / warm: (4/0.4=10, 12/0.6=20, 4/0.4=10) for ours
    assert out["speedup_vs_recompute"]["ours"]["mean"]["pairs"] == pytest.approx([10, 20, 10])
    assert out["speedup_vs_recompute"]["ours"]["mean"]["ratio"] == pytest.approx(
        (10 * 20 * 10) ** (1 / 3))
    # cold (2.0, 1.0) over warm, ours: 1.5/0.2, 1.5/0.3, 1.5/0.2
    assert out["cold_over_warm"]["ours"]["mean"]["pairs"] == pytest.approx([7.5, 5.0, 7.5])
    # medians over pairs, ms
    assert out["ttft_ms"]["ours"]["warm_first"] == pytest.approx(300.0)
    assert out["ttft_ms"]["stock"]["warm_mean"] == pytest.approx(450.0)
    assert out["ttft_ms"]["recompute"]["warm_mean"] == pytest.approx(2000.0)
    assert "cold_mean" not in out["ttft_ms"]["recompute"]


def test_a_run_whose_output_differs_from_recompute_fails_and_drops_its_pair() -> None:
    runs = _pair(0, [0.3, 0.1], [0.6, 0.2], [3.0, 1.0]) + _pair(1, [0.3, 0.1], [0.9, 0.3],
                                                                 [3.0, 1.0])
    stock = next(r for r in runs if r["pair"] == 0 and r["arm"] == "stock")
    stock["warm"]["outputs"][1] = [4, 5, 7]
    out = summarize(runs)
    assert out["valid_pairs"] == 1
    assert [(f["pair"], f["arm"]) for f in out["failed"]] == [(0, "stock")]
    assert "warm: output differs from recompute (prompts [2])" in out["failed"][0]["reasons"]
    assert out["stock_over_ours"]["mean"]["pairs"] == pytest.approx([3.0])
    assert math.isnan(out["stock_over_ours"]["mean"]["ci95"][0])  # one pair: no interval


def test_a_cold_output_mismatch_counts_too() -> None:
    runs = _pair(0, [0.3, 0.1], [0.6, 0.2], [3.0, 1.0])
    next(r for r in runs if r["arm"] == "ours")["cold"]["outputs"][0] = [9, 9, 9]
    out = summarize(runs)
    assert out["valid_pairs"] == 0
    assert out["failed"][0]["arm"] == "ours"
    assert out["failed"][0]["reasons"][0].startswith("cold: output differs")
    assert math.isnan(out["stock_over_ours"]["mean"]["ratio"])


@pytest.mark.parametrize("breakage, reason", [
    (lambda r: r.update(error="phase warm failed (exit code 1)"), "engine failed"),
    (lambda r: r.update(tier_ok=False, tier_class="vllm.x.FileSystemTierManager"),
     "tier type resolved to"),
    (lambda r: r["warm"].update(external_hit_tokens=[0, 0]), "no token from the tier"),
    (lambda r: r["warm"].update(ttft_s=[None, 0.1]), "without a time to first token"),
])
def test_every_kind_of_failure_is_named(breakage: Any, reason: str) -> None:
    runs = _pair(0, [0.3, 0.1], [0.6, 0.2], [3.0, 1.0])
    breakage(next(r for r in runs if r["arm"] == "ours"))
    out = summarize(runs)
    assert out["valid_pairs"] == 0
    [failure] = out["failed"]
    assert failure["arm"] == "ours"
    assert any(reason in why for why in failure["reasons"]), failure


def test_without_a_recompute_run_no_tier_run_is_verified() -> None:
    runs = _pair(0, [0.3, 0.1], [0.6, 0.2], [3.0, 1.0])
    next(r for r in runs if r["arm"] == "recompute")["error"] = "timed out"
    out = summarize(runs)
    assert {f["arm"] for f in out["failed"]} == {"ours", "stock", "recompute"}
    ours = next(f for f in out["failed"] if f["arm"] == "ours")
    assert any("no recompute run" in why for why in ours["reasons"])


def _split_runs(waits: list[tuple[float, float]]) -> list[dict[str, Any]]:
    """Pairs whose warm first prompt waited ``(ours, stock)`` seconds before its
    first schedule; the forward pass after it took 0.1 s (ours) and 0.2 s (stock)."""
    runs = []
    for i, (ours, stock) in enumerate(waits):
        for run in _pair(i, [ours + 0.1, 0.1], [stock + 0.2, 0.2], [3.0, 1.0]):
            if run["arm"] != "recompute":
                wait = ours if run["arm"] == "ours" else stock
                run["warm"]["queued_s"] = [wait, 0.01]
                run["warm"]["prefill_s"] = [0.1 if run["arm"] == "ours" else 0.2, 0.09]
            runs.append(run)
    return runs


def test_the_first_prompts_wait_for_the_tier_is_compared_on_its_own() -> None:
    out = summarize(_split_runs([(0.05, 0.10), (0.04, 0.12), (0.05, 0.05)]))
    split = out["warm_split"]
    assert split["stock_over_ours_wait"]["pairs"] == pytest.approx([2.0, 3.0, 1.0])
    assert split["stock_over_ours_wait"]["ratio"] == pytest.approx(6 ** (1 / 3))
    assert split["ms"]["ours"] == pytest.approx({"wait_first": 50.0, "prefill_first": 100.0})
    assert split["ms"]["stock"] == pytest.approx({"wait_first": 100.0, "prefill_first": 200.0})


def test_no_split_without_vllms_timestamps_in_every_valid_run() -> None:
    assert summarize(_pair(0, [0.3, 0.1], [0.6, 0.2], [3.0, 1.0]))["warm_split"] is None
    runs = _split_runs([(0.05, 0.10), (0.04, 0.12)])
    next(r for r in runs if r["arm"] == "stock" and r["pair"] == 1)["warm"]["queued_s"] = [None]
    assert summarize(runs)["warm_split"] is None
