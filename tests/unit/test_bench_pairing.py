"""The benchmarks' ratio: balanced over AB/BA round pairs (kvstore_tiers.bench.pairing)."""

from __future__ import annotations

import pytest

from kvstore_tiers.bench.pairing import balanced_ratio, even_rounds


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
