"""Ratios of two sides measured in alternating rounds, balanced for position.

On the build VM whichever side runs *second* in a round measured ~25 %
faster than the one that ran first (isolated 2 MiB load test, 9 rounds).
The benchmarks alternate the order (AB, BA, AB, ...), so rounds are taken
in AB/BA pairs: each pair's ratio is the geometric mean of its two rounds'
ratios, in which the position effect cancels, and the result is the median
over pairs. Drift between rounds cancels as well, since both sides of a
round are measured back to back.

:func:`ratio_interval` says how sure such a ratio is: the geometric mean of
the pairs' ratios with an approximate 95 % confidence interval, for the
long load-only series (``--reload-rounds``) that the disk-bound cells need.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def even_rounds(rounds: int) -> int:
    """``rounds`` rounded up to whole AB/BA pairs (1 stays 1: a quick look)."""
    return rounds + rounds % 2 if rounds > 1 else rounds


def round_ratios(ours: Sequence[float], base: Sequence[float]) -> list[float]:
    """Each round's ``ours[r] / base[r]``, rounded for reports."""
    return [round(a / b, 3) for a, b in zip(ours, base, strict=True)]


def _ratios(ours: Sequence[float], base: Sequence[float]) -> list[float]:
    return [a / b for a, b in zip(ours, base, strict=True)]


def _pair_ratios(ratios: Sequence[float]) -> list[float]:
    """Each AB/BA pair's geometric mean of its two rounds' ratios (an unpaired last is left out)."""
    return [math.sqrt(ratios[i] * ratios[i + 1]) for i in range(0, len(ratios) - 1, 2)]


def balanced_ratio(ours: Sequence[float], base: Sequence[float]) -> float:
    """Median over AB/BA round pairs of the geometric mean of the pair's ratios.

    ``ours[r] / base[r]`` is round ``r``'s ratio; an unpaired last round is
    used only when it is the only one.
    """
    ratios = _ratios(ours, base)
    if len(ratios) == 1:
        return ratios[0]
    return statistics.median(_pair_ratios(ratios))


def ratio_interval(ours: Sequence[float], base: Sequence[float], confidence: float = 0.95
                   ) -> tuple[float, float, float]:
    """(geometric mean, low, high) of the AB/BA pairs' ratios.

    The interval is the normal approximation on log ratios (mean +- z * standard
    error), so it is only meaningful with ten pairs or more; with fewer than two
    pairs it is (ratio, nan, nan).
    """
    ratios = _ratios(ours, base)
    logs = [math.log(r) for r in _pair_ratios(ratios)]
    if len(logs) < 2:
        r = balanced_ratio(ours, base) if ratios else math.nan
        return r, math.nan, math.nan
    mean = statistics.fmean(logs)
    half = (statistics.NormalDist().inv_cdf(0.5 + confidence / 2)
            * statistics.stdev(logs) / math.sqrt(len(logs)))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)
