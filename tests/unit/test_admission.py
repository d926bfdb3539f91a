"""The admission sketch and policies (kvstore_tiers.admission), without a tier."""

from __future__ import annotations

import random

import pytest

from kvstore_tiers import admission
from kvstore_tiers.admission import FrequencySketch, ReusePolicy
from kvstore_tiers.config import TierConfig, validate_config
from kvstore_tiers.errors import ConfigError
from kvstore_tiers.metrics import TierCounters
from kvstore_tiers.tools.harness import make_keys


@pytest.fixture(params=["native", "python"])
def native(request) -> bool:
    if request.param == "native":
        pytest.importorskip("kvstore_tiers._sketch")
        return True
    return False


def test_counts_each_sighting_up_to_the_cap(native) -> None:
    s = FrequencySketch(1 << 12, native=native)
    (key,) = make_keys(1)
    for n in range(1, 20):
        s.increment([key])
        assert s.estimate(key) == min(n, admission.MAX_COUNT)


def test_never_underestimates_and_rarely_overestimates(native) -> None:
    s = FrequencySketch(1 << 14, sample=1 << 30, native=native)
    keys = make_keys(2000, seed=1)
    rng = random.Random(0)
    truth = {k: rng.randint(0, 6) for k in keys}
    for k, n in truth.items():
        for _ in range(n):
            s.increment([k])
    over = sum(s.estimate(k) != n for k, n in truth.items())
    assert all(s.estimate(k) >= n for k, n in truth.items())
    assert over < len(keys) // 100  # 2,000 keys in 16,384 counters per row


def test_groups_of_one_block_count_apart(native) -> None:
    s = FrequencySketch(1 << 12, native=native)
    (h,) = make_keys(1)
    a, b = h[:32] + (0).to_bytes(4, "big"), h[:32] + (1).to_bytes(4, "big")
    s.increment([a, a, a])
    assert s.estimate(a) == 3 and s.estimate(b) == 0


def test_ageing_halves_every_counter_every_sample(native) -> None:
    s = FrequencySketch(1 << 10, sample=100, native=native)
    hot, *others = make_keys(101, seed=2)
    s.increment([hot] * 8)
    assert s.estimate(hot) == 8 and s.agings == 0
    s.increment(others[:92])  # the 100th increment
    assert s.agings == 1 and s.estimate(hot) == 4
    assert s.additions == 50


def test_memory_is_fixed_whatever_the_number_of_keys(native) -> None:
    s = FrequencySketch(1 << 10, native=native)
    before = s.nbytes
    for seed in range(20):
        s.increment(make_keys(500, seed=seed))
    assert s.nbytes == before == 4 * (1 << 10) and len(s.table) == before
    assert s.agings >= 9  # 10,000 sightings, halved every 1,024


def test_offer_answers_none_when_all_reach_the_threshold_else_their_indices(native) -> None:
    s = FrequencySketch(1 << 12, native=native)
    keys = make_keys(4, seed=3)
    s.increment([keys[1], keys[3]])
    assert s.offer(keys, 2) == [1, 3]  # 0 and 2 seen once (now), 1 and 3 twice
    assert s.offer(keys, 2) is None
    assert s.offer([], 2) is None
    assert s.offer(make_keys(3, seed=4), 2) == []


def test_bad_keys_and_widths_are_refused(native) -> None:
    s = FrequencySketch(1 << 10, native=native)
    with pytest.raises(TypeError):
        s.increment(["not bytes"])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        s.offer([b"short"], 2)
    with pytest.raises(ValueError):
        FrequencySketch(1000)


def test_the_compiled_kernel_and_its_python_twin_agree() -> None:
    pytest.importorskip("kvstore_tiers._sketch")
    c, p = FrequencySketch(1 << 8, sample=3000), FrequencySketch(1 << 8, sample=3000, native=False)
    assert c._offer is not p._offer
    rng = random.Random(5)
    pool = make_keys(600, seed=5) + [k[:32] + bytes([0, 0, 0, g]) for k in make_keys(20, 6)
                                     for g in range(3)]
    for _ in range(400):
        keys = rng.sample(pool, rng.randint(0, 24))
        if rng.random() < 0.3:
            c.increment(keys)
            p.increment(keys)
        else:
            threshold = rng.randint(1, 5)
            assert c.offer(keys, threshold) == p.offer(keys, threshold)
        assert c.table == p.table
    assert c.agings == p.agings > 0


def test_reuse_writes_on_the_nth_sighting_and_counts_the_rest() -> None:
    counters = TierCounters()
    policy = ReusePolicy(FrequencySketch(1 << 12), 3, counters)
    keys = make_keys(3, seed=7)
    assert policy.admit(keys) == []
    policy.seen(keys[:1])  # a load is a sighting
    assert policy.admit(keys) == [0]
    assert policy.admit(keys) is None
    assert counters.stores_not_admitted_rare == 3 + 2
    assert counters.stores_not_admitted_cold == 0


def test_select_keeps_keys_and_their_chunk_ids_together() -> None:
    assert admission.select([b"a", b"b", b"c"], [7, 8, 9], [0, 2]) == ([b"a", b"c"], [7, 9])


@pytest.mark.parametrize(("key", "value"), [
    ("admission", "sometimes"),
    ("admission_min_sightings", 1),
    ("admission_min_sightings", 16),
    ("admission_sketch_width", 3000),
    ("admission_sketch_width", 512),
])
def test_bad_admission_keys_fail_naming_the_key(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"key '{key}'"):
        validate_config(TierConfig, "fs", {key: value})


def test_admission_defaults_keep_writing_everything() -> None:
    config = TierConfig()
    assert config.admission == "always"
    assert config.admission_sketch_width == 1 << 20
