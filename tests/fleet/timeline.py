"""What a partition did to each host, read from the hosts' reports (tests/fleet/host.py).

Times are seconds from the cut (``time.monotonic()`` of the test and of the
hosts, one clock). ``None`` where the event never happened.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any


def _first(times: list[float]) -> float | None:
    return min(times) if times else None


@dataclass
class Window:
    """One host's requests that arrived in a window of time."""

    requests: int
    hits: int
    misses: int
    wrong: int
    resolve_p50_ms: float
    resolve_max_ms: float
    max_tier_ms: float
    max_tier_method: str

    @classmethod
    def of(cls, reqs: list[dict[str, Any]]) -> Window:
        resolve = [(r["t1"] - r["t0"]) * 1000 for r in reqs] or [0.0]
        slowest = max(reqs, key=lambda r: r["max_tier_ms"], default=None)
        return cls(len(reqs), sum(r["hits"] for r in reqs), sum(r["misses"] for r in reqs),
                   sum(r["wrong"] for r in reqs), statistics.median(resolve), max(resolve),
                   slowest["max_tier_ms"] if slowest else 0.0,
                   slowest["max_tier_method"] if slowest else "")


@dataclass
class HostTimeline:
    name: str  # the host
    before: Window  # arrived before the cut
    during: Window  # arrived between the cut and the heal
    after: Window  # arrived after the heal
    breaker_open_s: float | None  # first OPEN after the cut
    first_recompute_s: float | None  # first request after the cut with a miss: resolved at
    breaker_closed_s: float | None  # first CLOSED after the heal
    first_hit_after_heal_s: float | None  # first request after the heal all from the tier
    times_opened: int
    counters: dict[str, int]


def host_timeline(report: dict[str, Any], t_cut: float, t_heal: float) -> HostTimeline:
    reqs = report["requests"]
    rel = [{**r, "t0": r["t0"] - t_cut, "t1": r["t1"] - t_cut} for r in reqs]
    heal = t_heal - t_cut
    states = [(t - t_cut, s) for t, s in report["breaker"]]
    return HostTimeline(
        name=report["host"],
        before=Window.of([r for r in rel if r["t0"] < 0]),
        during=Window.of([r for r in rel if 0 <= r["t0"] < heal]),
        after=Window.of([r for r in rel if r["t0"] >= heal]),
        breaker_open_s=_first([t for t, s in states if s == "OPEN" and t >= 0]),
        first_recompute_s=_first([r["t1"] for r in rel if r["t0"] >= 0 and r["misses"]]),
        breaker_closed_s=_first([t for t, s in states if s == "CLOSED" and t >= heal]),
        first_hit_after_heal_s=_first([r["t1"] for r in rel
                                       if r["t0"] >= heal and r["hits"] == r["blocks"]]),
        times_opened=report["times_opened"],
        counters=report["counters"],
    )


def describe(server: str, heal_s: float, timelines: list[HostTimeline]) -> list[str]:
    """The timeline as lines of text, one host a line, then each host's windows."""

    def at(t: float | None) -> str:
        return "never" if t is None else f"{t:+.2f}s"

    lines = [f"{server}: cut at +0.00s, heal at {at(heal_s)}"]
    for h in timelines:
        lines.append(f"  {h.name}: breaker open {at(h.breaker_open_s)}, first recompute "
                     f"{at(h.first_recompute_s)}, closed {at(h.breaker_closed_s)}, first hit "
                     f"after heal {at(h.first_hit_after_heal_s)}, opened {h.times_opened}x")
        for label in ("before", "during", "after"):
            w: Window = getattr(h, label)
            lines.append(
                f"    {label:>6}: {w.requests} requests, {w.hits} blocks from the tier, "
                f"{w.misses} recomputed, {w.wrong} wrong; resolve p50 {w.resolve_p50_ms:.1f} "
                f"ms, max {w.resolve_max_ms:.1f} ms; slowest tier call {w.max_tier_ms:.1f} ms "
                f"({w.max_tier_method or '-'})")
    return lines
