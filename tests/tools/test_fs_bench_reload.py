"""``bench --reload-rounds``: load-only rounds of both fs tiers on one stored window."""

from __future__ import annotations

import math

from kvstore_tiers.plugin import register
from kvstore_tiers.tools.bench.fs_bench import reload_rounds


def test_reload_rounds_reread_every_key_of_both_tiers_and_clean_up(tmp_path) -> None:
    register()  # "vllm_fs" beside our "fs", as the bench has it
    # 3 rounds become 4 (two AB/BA pairs); load_round raises unless every key
    # of every round came back as a HIT in the primary.
    row = reload_rounds(tmp_path, 64 * 1024, 16, 4, 3)
    assert row["rounds"] == 4 and len(row["load_ratios"]) == 4
    assert row["kvstore_load_gbps"] > 0 and row["vllm_load_gbps"] > 0
    low, high = row["load_ratio_ci95"]
    assert low <= row["load_ratio"] <= high or (math.isnan(low) and math.isnan(high))
    assert list(tmp_path.iterdir()) == []  # both tiers' files removed
