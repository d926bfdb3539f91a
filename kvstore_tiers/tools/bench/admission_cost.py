"""Scheduler-thread cost of store admission: a paired A/B through vLLM's real manager.

``python -m kvstore_tiers.tools.bench.admission_cost --rounds 6``

Each round measures the fs tier three times, ``admission`` off (``always``),
``reuse`` and ``adaptive``, in an order rotated every round (so each arm
runs first, second and third equally often), with the waves of
:func:`~kvstore_tiers.tools.bench.fs_bench.scheduler_cost`: about 1,000
chunks queued at once as 16-chunk store jobs, then promoted back, every
scheduler-side call timed. Before each wave the keys are counted once as
sightings (untimed), so that ``reuse`` admits them and every arm stores the
same blocks: the difference is what admission costs where it admits
everything (``always``'s keys go through a scratch sketch, so that every
arm's are as warm in the caches). ``adaptive`` runs on an unbounded tier
(write everything, the miniatures running beside it). ``--unseen`` leaves
the sightings out: ``reuse`` then admits no block (a first sighting each),
the gated case, where its jobs go to the I/O threads and come back with
nothing written; there every arm only stores (no promotions: ``reuse``
would have nothing to promote).

Reports, per arm, the p50 and p99 of ``submit_store``, ``submit_load`` and
``get_finished_jobs``, the total time of every timed scheduler-side call
(``all``), and their ratios to ``always`` of the same round: the geometric
mean over rounds with a 95 % Student-t interval.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvstore_tiers.admission import policy_of
from kvstore_tiers.config import TierConfig
from kvstore_tiers.sketch import FrequencySketch
from kvstore_tiers.tools.bench.fs_bench import scheduler_cost
from kvstore_tiers.tools.bench.pairing import geomean_interval

ARMS = ("always", "reuse", "adaptive")
METHODS = ("submit_store", "submit_load", "get_finished_jobs")


def _sightings(width: int) -> Callable[[Any, list[bytes]], None]:
    """Before a wave: its keys counted once as sightings by the tier's policy, or,
    with ``always``, by a scratch sketch of the same width. Every arm's keys then
    pass through a sketch once, untimed, and are as warm in the caches when the
    timed calls read them (where only the policies' arms counted, theirs read
    cheaper than ``always``'s for warm keys, not for less work)."""
    scratch = FrequencySketch(width)

    def count(tier: Any, keys: list[bytes]) -> None:
        policy = policy_of(tier)
        (policy.seen if policy is not None else scratch.increment)(keys)

    return count


def measure(arm: str, directory: Path, chunk: int, in_flight: int, waves: int,
            extra: dict[str, Any], sighted: bool = True) -> dict[str, dict[str, float]]:
    root = Path(tempfile.mkdtemp(prefix=f"bench-admission-{arm}-", dir=directory))
    width = extra.get("admission_sketch_width",
                      TierConfig.model_fields["admission_sketch_width"].default)
    try:
        report = scheduler_cost("kvstore", root, chunk, 16, in_flight, waves=waves,
                                tier_extra={"admission": arm, **extra},
                                before_wave=_sightings(width) if sighted else None,
                                promote=sighted)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report["all"] = {"total_us": sum(m["total_us"] for m in report.values())}
    return report


def run(directory: Path, rounds: int, chunk: int, in_flight: int, waves: int,
        extra: dict[str, Any] | None = None, sighted: bool = True) -> dict[str, Any]:
    extra = extra or {}
    results: dict[str, list[dict[str, dict[str, float]]]] = {a: [] for a in ARMS}
    for r in range(rounds):
        order = ARMS[r % 3:] + ARMS[:r % 3]
        for arm in order:
            results[arm].append(measure(arm, directory, chunk, in_flight, waves,
                                        extra if arm != "always" else {}, sighted))
        print(f"round {r + 1}/{rounds} ({', '.join(order)}): " + "; ".join(
            f"{a} store p50/p99 {results[a][-1]['submit_store']['p50_us']:.1f}/"
            f"{results[a][-1]['submit_store']['p99_us']:.1f} us" for a in ARMS), flush=True)
    summary: dict[str, Any] = {}
    figures = [(m, q) for m in METHODS for q in ("p50_us", "p99_us", "total_us")]
    for method, q in [*figures, ("all", "total_us")]:
        base = [res[method][q] for res in results["always"]]
        for arm in ARMS:
            vals = [res[method][q] for res in results[arm]]
            entry = summary.setdefault(method, {}).setdefault(arm, {})
            entry[q] = sorted(vals)[len(vals) // 2]
            pairs = [(v, b) for v, b in zip(vals, base, strict=True)
                     if v == v and b == b and b > 0]  # no calls (nan): no ratio
            if arm != "always" and len(pairs) == len(vals):
                ratio, lo, hi = geomean_interval([v / b for v, b in pairs])
                # Three significant digits: a wide interval's low end (two
                # rounds, t = 12.7) is small but never 0.
                entry[q.replace("_us", "_ratio")] = [float(f"{x:.3g}")
                                                     for x in (ratio, lo, hi)]
    return {"rounds": rounds, "chunk": chunk, "in_flight": in_flight, "waves": waves,
            "extra": extra, "sighted": sighted,
            "summary": summary, "raw": results}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--chunk-kib", type=int, default=16)
    ap.add_argument("--in-flight", type=int, default=1024)
    ap.add_argument("--waves", type=int, default=16)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--sketch-width", type=int, help="admission_sketch_width of the "
                    "reuse and adaptive arms (default: the tier's default)")
    ap.add_argument("--unseen", action="store_true", help="count no sightings before the "
                    "waves: reuse admits no block (the gated case)")
    ap.add_argument("--json", type=Path, help="write the full result here")
    args = ap.parse_args(argv)
    extra = {"admission_sketch_width": args.sketch_width} if args.sketch_width else {}
    out = run(args.dir, args.rounds, args.chunk_kib * 1024, args.in_flight, args.waves, extra,
              sighted=not args.unseen)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    print(json.dumps(out["summary"], indent=1))


if __name__ == "__main__":
    main()
