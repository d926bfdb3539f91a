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


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile ``t_p`` with ``df`` degrees of freedom.

    Exact for 1 and 2 degrees of freedom; from 3 on, the Cornish-Fisher
    expansion around the normal quantile (the 95 % two-sided value is 0.004
    low at 3, within 0.001 from 4 on)."""
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    if df == 1:
        return math.tan(math.pi * (p - 0.5))
    if df == 2:
        return (2 * p - 1) / math.sqrt(2 * p * (1 - p))
    z = statistics.NormalDist().inv_cdf(p)
    n = float(df)
    return (z + (z**3 + z) / (4 * n)
            + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * n**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * n**3)
            + (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / (92160 * n**4))


def geomean_interval(ratios: Sequence[float], confidence: float = 0.95
                     ) -> tuple[float, float, float]:
    """(geometric mean, low, high) of per-pair ratios, the interval from Student's t.

    For few pairs (the engine benchmark's 6): the t interval on log ratios,
    ``mean +- t(n-1) * sd / sqrt(n)``, is exact for log-normal scatter where
    the normal approximation of :func:`ratio_interval` is too narrow. One
    ratio gives (ratio, nan, nan); none gives three nans."""
    logs = [math.log(r) for r in ratios]
    if not logs:
        return math.nan, math.nan, math.nan
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), math.nan, math.nan
    half = (t_quantile(0.5 + confidence / 2, len(logs) - 1)
            * statistics.stdev(logs) / math.sqrt(len(logs)))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)
