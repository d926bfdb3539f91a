"""The benchmarks' ratio: balanced over AB/BA round pairs (kvstore_tiers.tools.bench.pairing)."""

from __future__ import annotations

import pytest

from kvstore_tiers.tools.bench.pairing import balanced_ratio, even_rounds


def test_a_position_effect_cancels_out() -> None:
    # Equal sides, but whoever runs second in a round is 25 % faster; the
    # order alternates AB, BA, ... A plain median of per-round ratios over
    # 3 rounds (A first twice) would say 0.8.
    ours = [0.8, 1.0, 0.8, 1.0]
    base = [1.0, 0.8, 1.0, 0.8]
    assert balanced_ratio(ours, base) == pytest.approx(1.0)


def test_a_real_difference_survives_and_drift_between_rounds_cancels() -> None:
    # Ours 1.5x faster; the machine halves its speed from round to round.
    base = [1.0, 0.5, 0.25, 0.125]
    ours = [1.5 * b for b in base]
    assert balanced_ratio(ours, base) == pytest.approx(1.5)


def test_rounds_come_in_pairs() -> None:
    assert [even_rounds(n) for n in (1, 2, 3, 5, 6)] == [1, 2, 4, 6, 6]
    assert balanced_ratio([2.0], [1.0]) == 2.0  # one quick round: its own ratio
    assert balanced_ratio([2.0, 2.0, 9.0], [1.0, 1.0, 1.0]) == pytest.approx(2.0)  # unpaired last


def test_an_interval_excludes_one_only_when_the_pairs_agree() -> None:
    from kvstore_tiers.tools.bench.pairing import ratio_interval

    # Ten AB/BA pairs, each pair 1.2x apart in its geometric mean, with
    # +-10 % scatter inside the pairs: the interval sits around 1.2 and off 1.0.
    base = [1.0] * 20
    ours = [1.2 * (1.1 if i % 4 in (0, 3) else 1 / 1.1) * (1.02 if i % 3 else 0.98)
            for i in range(20)]
    ratio, low, high = ratio_interval(ours, base)
    assert low < ratio < high
    assert 1.15 < ratio < 1.25 and low > 1.0
    # The same sides, but pairs that disagree (0.7x, 1.4x, ...): the interval spans 1.0.
    ours = [(0.7 if (i // 2) % 2 else 1.4) for i in range(20)]
    ratio, low, high = ratio_interval(ours, base)
    assert low < 1.0 < high


def test_an_interval_needs_two_pairs() -> None:
    import math

    from kvstore_tiers.tools.bench.pairing import ratio_interval

    ratio, low, high = ratio_interval([2.0, 2.0], [1.0, 1.0])
    assert ratio == pytest.approx(2.0) and math.isnan(low) and math.isnan(high)


def test_t_quantiles_match_the_table() -> None:
    from kvstore_tiers.tools.bench.pairing import t_quantile

    # Two-sided 95 % critical values of Student's t (any statistics table).
    table = {1: 12.706, 2: 4.303, 3: 3.182, 5: 2.571, 10: 2.228, 30: 2.042}
    for df, value in table.items():
        assert t_quantile(0.975, df) == pytest.approx(value, abs=0.005)
    assert t_quantile(0.5, 7) == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError):
        t_quantile(0.975, 0)


def test_a_geomean_interval_over_six_pairs() -> None:
    import math
    import statistics

    from kvstore_tiers.tools.bench.pairing import geomean_interval

    ratios = [1.6, 1.8, 1.5, 1.9, 1.7, 1.65]
    gm, low, high = geomean_interval(ratios)
    logs = [math.log(r) for r in ratios]
    assert gm == pytest.approx(math.exp(statistics.fmean(logs)))
    # t with 5 degrees of freedom, not the normal 1.96: wider
    half = 2.5706 * statistics.stdev(logs) / math.sqrt(6)
    assert low == pytest.approx(gm * math.exp(-half), rel=1e-3)
    assert high == pytest.approx(gm * math.exp(half), rel=1e-3)
    assert 1.5 < low < gm < high < 1.9
    # identical pairs: no width; one pair: no interval; none: nothing
    assert geomean_interval([2.0, 2.0, 2.0]) == pytest.approx((2.0, 2.0, 2.0))
    one = geomean_interval([1.5])
    assert one[0] == pytest.approx(1.5) and math.isnan(one[1]) and math.isnan(one[2])
    assert all(math.isnan(x) for x in geomean_interval([]))
