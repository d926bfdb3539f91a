"""The engine benchmark's figures from its runs' numbers (no engine here).

:mod:`.engine_bench` runs, per pair, one run of each arm -- our fs tier
(``ours``), vLLM's stock fs tier (``stock``), no tier (``recompute``) -- and
hands each run over as a record::

    {"pair": 0, "position": 0, "arm": "ours", "error": None,
     "tier_ok": True,            # the tier type resolved to the arm's class
     "cold": PHASE or None,      # phase 1 (tier arms only): stores the prompts' KV
     "warm": PHASE or None}      # phase 2: a fresh engine process answers the prompts

    PHASE = {"ttft_s": [...], "outputs": [[token ids], ...],
             "external_hit_tokens": [...]}

A run **fails** when its engine failed, its tier type resolved to another
class, an output of either phase differs from the same pair's ``recompute``
run (greedy decoding: a tier must never change the answer), or its warm
phase got no token from the tier. A pair counts only when all its runs
passed; the ratios are geometric means over those pairs with a Student's t
95 % interval (:func:`.pairing.geomean_interval`).

A run's TTFT is the mean over its prompts of vLLM's own time to first token
(so a ratio of two runs is the ratio of their total waits); the first prompt
(the long one whose whole prefix the warm phase reads from the tier) is also
reported on its own.

Each warm TTFT is also split by vLLM's engine-core timestamps (a phase's
``queued_s`` and ``prefill_s``, see :mod:`kvstore_tiers.tools.demo.phase`):
the wait before the request's first schedule, which in a warm phase is the
tier's (lookups, then the load into the CPU primary), and the forward pass
after it, which is the engine's and the machine's. The first prompt's wait
is compared on its own (``stock_over_ours_wait``): on a shared machine the
forward pass moves with the load of other jobs and can swamp the tier's
difference in the TTFT ratio.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from kvstore_tiers.tools.bench.pairing import geomean_interval

ARMS = ("ours", "stock", "recompute")
TIER_ARMS = ("ours", "stock")


def run_failures(run: dict[str, Any], reference: list[list[int]] | None) -> list[str]:
    """Why ``run`` does not count (empty: it passed). ``reference``: the
    outputs of its pair's recompute run (None: that run failed)."""
    if run.get("error"):
        return [f"engine failed: {run['error']}"]
    reasons = []
    arm = run["arm"]
    phases = ("cold", "warm") if arm in TIER_ARMS else ("warm",)
    if arm in TIER_ARMS and not run.get("tier_ok", False):
        reasons.append(f"tier type resolved to {run.get('tier_class')!r}, not the {arm} tier")
    for name in phases:
        phase = run.get(name)
        if not phase:
            reasons.append(f"no {name} phase")
            continue
        if any(t is None or t <= 0 for t in phase["ttft_s"]):
            reasons.append(f"{name}: a prompt without a time to first token")
        if reference is None and arm in TIER_ARMS:
            reasons.append("no recompute run in this pair to compare outputs with")
        elif reference is not None and phase["outputs"] != reference:
            bad = [i + 1 for i, (a, b) in enumerate(zip(phase["outputs"], reference,
                                                        strict=False)) if a != b]
            reasons.append(f"{name}: output differs from recompute (prompts {bad or 'count'})")
    warm = run.get("warm")
    if arm in TIER_ARMS and warm and not sum(warm.get("external_hit_tokens", [])):
        reasons.append("warm phase got no token from the tier")
    return reasons


def mean_ttft(phase: dict[str, Any]) -> float:
    return statistics.fmean(phase["ttft_s"])


def _interval(ratios: Sequence[float]) -> dict[str, Any]:
    gm, low, high = geomean_interval(ratios)
    return {"ratio": gm, "ci95": [low, high], "pairs": [round(r, 4) for r in ratios]}


def _median_ms(values: Sequence[float]) -> float:
    return statistics.median(values) * 1000 if values else math.nan


def _split(valid: Sequence[dict[str, dict[str, Any]]]) -> dict[str, Any] | None:
    """The warm first prompt's wait and forward pass per tier arm (medians, ms),
    and the paired ratio of the waits; None unless every valid run has both."""
    def part(p: dict[str, dict[str, Any]], arm: str, key: str) -> float | None:
        values = p[arm]["warm"].get(key) or [None]
        return values[0]

    parts = [(part(p, arm, "queued_s"), part(p, arm, "prefill_s"))
             for p in valid for arm in TIER_ARMS]
    if not valid or any(q is None or q <= 0 or f is None for q, f in parts):
        return None
    return {
        "ms": {arm: {"wait_first": _median_ms([part(p, arm, "queued_s") for p in valid]),
                     "prefill_first": _median_ms([part(p, arm, "prefill_s") for p in valid])}
               for arm in TIER_ARMS},
        "stock_over_ours_wait": _interval([part(p, "stock", "queued_s")
                                           / part(p, "ours", "queued_s") for p in valid]),
    }


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Failures, per-arm TTFT medians and the paired ratios of ``runs``.

    Returns ``{"pairs", "valid_pairs", "failed": [{"pair", "arm", "reasons"}],
    "ttft_ms": {arm: {"warm_mean", "warm_first", "cold_mean", "cold_first"}},
    "stock_over_ours": {"mean", "first"}, "speedup_vs_recompute": {arm: {"mean",
    "first"}}, "cold_over_warm": {arm: ...}, "warm_split": {"ms": {arm: {"wait_first",
    "prefill_first"}}, "stock_over_ours_wait"} or None}``; each ratio is ``{"ratio",
    "ci95", "pairs"}`` over the valid pairs (larger is better for ours)."""
    by_pair: dict[int, dict[str, dict[str, Any]]] = {}
    for r in runs:
        by_pair.setdefault(int(r["pair"]), {})[r["arm"]] = r
    failed = []
    valid: list[dict[str, dict[str, Any]]] = []
    for pair in sorted(by_pair):
        arms = by_pair[pair]
        rec = arms.get("recompute")
        reference = None
        if rec is not None and not run_failures(rec, None):
            reference = rec["warm"]["outputs"]
        ok = True
        for arm in ARMS:
            run = arms.get(arm)
            reasons = (run_failures(run, reference) if run is not None
                       else ["not run"])
            if reasons:
                ok = False
                failed.append({"pair": pair, "arm": arm, "reasons": reasons})
        if ok:
            valid.append(arms)
    out: dict[str, Any] = {"pairs": len(by_pair), "valid_pairs": len(valid), "failed": failed}
    out["ttft_ms"] = {
        arm: {
            "warm_mean": _median_ms([mean_ttft(p[arm]["warm"]) for p in valid]),
            "warm_first": _median_ms([p[arm]["warm"]["ttft_s"][0] for p in valid]),
            **({"cold_mean": _median_ms([mean_ttft(p[arm]["cold"]) for p in valid]),
                "cold_first": _median_ms([p[arm]["cold"]["ttft_s"][0] for p in valid])}
               if arm in TIER_ARMS else {}),
        }
        for arm in ARMS
    }

    def ratios(num: tuple[str, str], den: tuple[str, str]) -> dict[str, Any]:
        """num/den over valid pairs, each (arm, phase); for the mean and the first prompt."""
        def value(p: dict[str, dict[str, Any]], side: tuple[str, str], first: bool) -> float:
            phase = p[side[0]][side[1]]
            return phase["ttft_s"][0] if first else mean_ttft(phase)

        return {key: _interval([value(p, num, first) / value(p, den, first) for p in valid])
                for key, first in (("mean", False), ("first", True))}

    out["stock_over_ours"] = ratios(("stock", "warm"), ("ours", "warm"))
    out["speedup_vs_recompute"] = {arm: ratios(("recompute", "warm"), (arm, "warm"))
                                   for arm in TIER_ARMS}
    out["cold_over_warm"] = {arm: ratios((arm, "cold"), (arm, "warm")) for arm in TIER_ARMS}
    out["warm_split"] = _split(valid)
    return out
