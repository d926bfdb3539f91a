"""The admission sketch and policies (kvstore_tiers.admission), without a tier."""

from __future__ import annotations

import random

import pytest

from kvstore_tiers import admission, sketch
from kvstore_tiers.admin.harness import make_keys
from kvstore_tiers.admission import ReusePolicy
from kvstore_tiers.config import WRITE_COST, TierConfig, validate_config
from kvstore_tiers.errors import ConfigError
from kvstore_tiers.metrics import TierCounters
from kvstore_tiers.sketch import FrequencySketch


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
        assert s.estimate(key) == min(n, sketch.MAX_COUNT)


def test_never_underestimates_and_rarely_overestimates(native) -> None:
    s = FrequencySketch(1 << 14, period=1 << 30, native=native)
    keys = make_keys(2000, seed=1)
    rng = random.Random(0)
    truth = {k: rng.randint(0, 6) for k in keys}
    for k, n in truth.items():
        for _ in range(n):
            s.increment([k])
    over = sum(s.estimate(k) != n for k, n in truth.items())
    assert all(s.estimate(k) >= n for k, n in truth.items())
    assert over < len(keys) // 100  # 2,000 keys in 16,384 counters per row


@pytest.mark.parametrize("hash_len", [32, 16])  # sha256, xxhash block hashes
def test_groups_of_one_block_count_apart(native, hash_len: int) -> None:
    s = FrequencySketch(1 << 12, native=native)
    (h,) = make_keys(1)
    a, b = h[:hash_len] + (0).to_bytes(4, "big"), h[:hash_len] + (1).to_bytes(4, "big")
    s.increment([a, a, a])
    assert s.estimate(a) == 3 and s.estimate(b) == 0


def _xxhash_keys(n: int, seed: int) -> list[bytes]:
    """OffloadKeys of a 16-byte block hash (``--prefix-caching-hash-algo xxhash``)."""
    return [k[:16] + k[32:] for k in make_keys(n, seed=seed)]


def test_adaptive_takes_keys_of_a_16_byte_hash(native) -> None:
    policy = admission.AdaptivePolicy(FrequencySketch(1 << 12, native=native),
                                      _signal(10**9, 10**9), sample_limit=256)
    keys = _xxhash_keys(8, seed=30)
    policy.seen(keys[:4])
    assert policy.admit(keys) == [0, 1, 2, 3]  # full: the gate admits the seen ones
    assert len(policy._samples) == 2 * 12  # every sighting sampled (4 + 8), none refused


def test_ageing_halves_every_counter_every_sample(native) -> None:
    s = FrequencySketch(1 << 10, period=100, native=native)
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
    c, p = FrequencySketch(1 << 8, period=3000), FrequencySketch(1 << 8, period=3000, native=False)
    assert c._offer is not p._offer
    rng = random.Random(5)
    pool = make_keys(600, seed=5) + [k[:32] + bytes([0, 0, 0, g]) for k in make_keys(20, 6)
                                     for g in range(3)] + _xxhash_keys(100, seed=7)
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


def test_reuse_writes_on_the_nth_sighting() -> None:
    policy = ReusePolicy(FrequencySketch(1 << 12), 3)
    keys = make_keys(3, seed=7)
    assert policy.admit(keys) == []
    policy.seen(keys[:1])  # a load is a sighting
    assert policy.admit(keys) == [0]
    assert policy.admit(keys) is None


def test_each_policy_counts_what_it_skips_in_its_own_counter() -> None:
    keys = make_keys(3, seed=8)
    reuse = ReusePolicy(FrequencySketch(1 << 12), 2)
    assert reuse.admit(keys) == []  # first sighting: none written
    counters = TierCounters()
    reuse.report(counters)
    assert counters.stores_not_admitted_rare == 3 and counters.stores_not_admitted_cold == 0
    assert reuse.admit(keys) is None  # second: all written, nothing more counted
    reuse.report(counters)
    assert counters.stores_not_admitted_rare == 3


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


@pytest.mark.parametrize("value", [-0.1, 2])
def test_a_write_cost_out_of_range_fails_naming_the_key(value: float) -> None:
    # Out of range, not an unknown key.
    with pytest.raises(ConfigError, match=r"key 'admission_write_cost': Input should be "
                       r"(greater|less) than or equal"):
        validate_config(TierConfig, "fs", {"admission_write_cost": value})


def test_admission_defaults_keep_writing_everything() -> None:
    config = TierConfig()
    assert config.admission == "always"
    assert config.admission_sketch_width == 1 << 18
    assert config.admission_write_cost == WRITE_COST == 0.08


# -- adaptive --------------------------------------------------------------------------

class _Writes:
    objects_stored = 0
    stored_bytes_written = 0


def _signal(used: int, capacity: int | None, budget: int | None = None,
            row_bytes: int = 1000) -> admission.CapacitySignal:
    sig = admission.CapacitySignal(lambda: None if capacity is None else (used, capacity),
                                   budget, _Writes(), row_bytes)
    sig.refresh()
    return sig


def _sampled_keys(n: int, seed: int) -> list[bytes]:
    """Keys every sample takes (the last hash byte is 0)."""
    return [k[:31] + b"\0" + k[32:] for k in make_keys(n, seed=seed)]


def test_the_capacity_signal_reads_full_past_its_fraction_and_counts_blocks() -> None:
    assert not _signal(700_000, 1_000_000).full
    full = _signal(800_000, 1_000_000)
    assert full.full and full.blocks == 1000  # at the row size until something is written
    unbounded = _signal(10**12, None)
    assert not unbounded.full and unbounded.blocks == 0
    budget = _signal(0, None, budget=1_000_000)  # s3: the bytes this process wrote
    assert not budget.full
    budget._counters.objects_stored, budget._counters.stored_bytes_written = 2000, 900_000
    budget.refresh()
    assert budget.full and budget.blocks == 2222  # at the mean frame size written


def test_blocks_are_counted_at_the_backends_size_of_an_object() -> None:
    """redis counts each key's name and bookkeeping in its used memory: a full
    tier holds fewer objects than its capacity over the frame size."""
    writes = _Writes()
    writes.objects_stored, writes.stored_bytes_written = 100, 1_000_000  # 10,000 B frames
    sizes: list[object] = [None, 12_500, ConnectionError("down"), 0]

    def object_bytes() -> int | None:
        r = sizes.pop(0)
        if isinstance(r, Exception):
            raise r
        return r  # type: ignore[return-value]

    sig = admission.CapacitySignal(lambda: (900_000, 1_000_000), None, writes, 10,
                                   object_bytes=object_bytes)
    sig.refresh()
    assert sig.blocks == 100  # no reading yet: the frame size
    sig.refresh()
    assert sig.object_size == 12_500 and sig.blocks == 80
    sig.refresh()  # a failed reading, then none: the last one holds
    sig.refresh()
    assert sig.blocks == 80
    # A budget over the bytes this process wrote counts frames, not the backend's size.
    budget = admission.CapacitySignal(None, 1_000_000, writes, 10, object_bytes=lambda: 12_500)
    budget.refresh()
    assert budget.blocks == 100


def test_a_failing_capacity_reading_keeps_the_last_one() -> None:
    readings: list[object] = [(900, 1000)]

    def usage() -> tuple[int, int]:
        r = readings.pop(0)
        if isinstance(r, Exception):
            raise r
        return r  # type: ignore[return-value]

    sig = admission.CapacitySignal(usage, None, _Writes(), 10)
    sig.refresh()
    readings.append(ConnectionError("down"))
    sig.refresh()
    assert sig.full and sig.blocks == 100


def test_a_tier_that_evicted_lately_is_full_below_the_fraction() -> None:
    # An evictor with a low watermark of 0.5: after a round the tier holds
    # half its capacity, and it is still full (the next round comes).
    reading, evicted, now = [(950, 1000)], [0], [0.0]
    sig = admission.CapacitySignal(lambda: reading[0], None, _Writes(), 10,
                                   evictions=lambda: evicted[0], clock=lambda: now[0])
    sig.refresh()
    assert sig.full
    reading[0], evicted[0], now[0] = (500, 1000), 40, 1.0
    sig.refresh()
    assert sig.full
    now[0] = 1.0 + sig.EVICTION_HOLD_S - 1
    sig.refresh()
    assert sig.full  # no eviction since, within the hold
    now[0] = 1.0 + sig.EVICTION_HOLD_S
    sig.refresh()
    assert not sig.full  # none for the whole hold, and room: not full
    # Evictions counted before the signal started do not make it full.
    sig = admission.CapacitySignal(lambda: (500, 1000), None, _Writes(), 10,
                                   evictions=lambda: 40, clock=lambda: 0.0)
    sig.refresh()
    assert not sig.full


def test_the_blocks_are_what_the_tier_holds_between_evictions_not_its_capacity() -> None:
    # An fs evictor with watermarks 0.95 and 0.5: the tier swings between
    # them once full; the miniatures must replay the tier it is on average.
    reading, evicted, now = [(850, 1000)], [0], [0.0]
    sig = admission.CapacitySignal(lambda: reading[0], None, _Writes(), 10,
                                   evictions=lambda: evicted[0], clock=lambda: now[0])
    sig.refresh()
    assert sig.full and sig.fill == 1.0 and sig.blocks == 100  # filling: not counted
    for i in range(200):
        reading[0] = (950, 1000) if i % 2 else (500, 1000)
        evicted[0] += i % 2
        now[0] += 0.5
        sig.refresh()
    assert sig.fill == pytest.approx(0.725, abs=0.01)
    assert sig.blocks == int(1000 * sig.fill) // 10
    # A moving mean: a tier that now stays at its capacity is read as such.
    reading[0] = (1000, 1000)
    for _ in range(5 * sig.FILL_READINGS):
        evicted[0] += 1
        sig.refresh()
    assert sig.fill == pytest.approx(1.0, abs=0.01) and sig.blocks >= 99
    # No capacity any more: what it held says nothing of a limit set later.
    reading[0] = None  # type: ignore[call-overload]
    sig.refresh()
    assert (sig.full, sig.blocks, sig.fill) == (False, 0, 1.0)


def test_the_fill_counts_a_slow_evictors_whole_cycle() -> None:
    # An evictor that takes 10 minutes (1,200 readings) to refill from 0.5 to
    # 0.95: the readings after the eviction hold count too, or the fill would
    # be the bottom of the cycle.
    reading, evicted, now = [(950, 1000)], [0], [0.0]
    sig = admission.CapacitySignal(lambda: reading[0], None, _Writes(), 10,
                                   evictions=lambda: evicted[0], clock=lambda: now[0])
    fills = []
    for _cycle in range(4):
        evicted[0] += 1
        for i in range(1200):
            reading[0] = (500 + 450 * i // 1199, 1000)
            now[0] += 0.5
            sig.refresh()
            fills.append(sig.fill)
    last = fills[-1200:]  # an average over about one cycle swings a little within it
    assert sum(last) / len(last) == pytest.approx(0.725, abs=0.01)
    assert min(last) > 0.67 and max(last) < 0.78


def test_without_a_count_of_bytes_held_the_blocks_are_the_capacitys() -> None:
    # s3 or a plugin without capacity_usage: the bytes this process wrote only
    # grow; they are not what the tier holds.
    writes, evicted = _Writes(), [0]
    writes.objects_stored, writes.stored_bytes_written = 100, 500_000
    sig = admission.CapacitySignal(None, 1_000_000, writes, 10, evictions=lambda: evicted[0])
    for _ in range(10):
        evicted[0] += 1
        sig.refresh()
    assert sig.fill == 1.0 and sig.blocks == 200


def test_adaptive_writes_everything_while_the_tier_has_room(native) -> None:
    policy = admission.AdaptivePolicy(FrequencySketch(1 << 12, native=native),
                                      _signal(0, 10**9))
    keys = make_keys(8, seed=8)
    assert policy.admit(keys) is None
    assert policy.sketch.estimate(keys[0]) == 1  # still counted


def test_adaptive_gates_first_sightings_once_full() -> None:
    sig = _signal(0, 10**9)
    policy = admission.AdaptivePolicy(FrequencySketch(1 << 12), sig)
    seen = make_keys(2, seed=9)
    policy.seen(seen)  # loaded once: a sighting
    sig._usage = lambda: (10**9, 10**9)
    sig.refresh()
    assert sig.full and policy.threshold == 2
    new = make_keys(3, seed=10)
    assert policy.admit(new[:1] + seen + new[1:]) == [1, 2]
    policy.threshold = 1  # the miniatures found writing everything better
    assert policy.admit(make_keys(3, seed=11)) is None


def _run(policy: admission.AdaptivePolicy, stream: list[bytes]) -> None:
    for key in stream:
        policy.admit([key])
    policy.update()


def test_the_miniatures_choose_write_everything_when_reuse_comes_soon() -> None:
    # A tier of 2,560 blocks: the miniatures (1 in 16 of the sightings) hold 160.
    policy = admission.AdaptivePolicy(FrequencySketch(1 << 16), _signal(2_560_000, 2_560_000))
    assert policy.signal.blocks == 2560
    keys = _sampled_keys(2000, seed=12)
    stream = []
    for i in range(0, 2000, 50):  # each block read again 50 sightings later, once
        stream += keys[i:i + 50] + keys[i:i + 50]
    _run(policy, stream)
    assert policy.hits_write_all > 1.25 * policy.hits_gated
    assert policy.threshold == 1


def test_a_hot_block_in_the_sample_does_not_hide_what_writing_everything_gains() -> None:
    # Every request starts with the same system prompt, and the hash sample
    # happens to take its blocks. They are hits in both miniatures at every
    # request: the hits' ratio nears 1 while their difference stays.
    policy = admission.AdaptivePolicy(FrequencySketch(1 << 16), _signal(2_560_000, 2_560_000))
    prompt = _sampled_keys(8, seed=15)
    fresh = make_keys(50 * 200, seed=16)  # 1 in 16 sampled, by their hash
    once = make_keys(100 * 200, seed=21)  # stored, never read: writes, no hits
    for i in range(200):  # each turn's blocks are stored, then loaded once
        turn = prompt + fresh[i * 50:(i + 1) * 50]
        policy.admit(turn + once[i * 100:(i + 1) * 100])
        policy.seen(turn)
    policy.update()
    assert policy.hits_write_all < 1.25 * policy.hits_gated  # a ratio would gate here
    # A hit per two writes it adds: well over the cost of a write.
    added = policy.writes_write_all - policy.writes_gated
    assert policy.hits_write_all - policy.hits_gated > 0.3 * added > 0
    assert policy.threshold == 1


def _reuse_among_one_timers(once_per_reuse: int, groups: int, tier_bytes: int = 2_560_000
                            ) -> admission.AdaptivePolicy:
    """Sampled blocks, each read again at once, each followed by
    ``once_per_reuse`` sampled blocks never seen again: writing everything
    gains a hit per group (the gated miniature writes the reused block at its
    second sighting) and adds ``once_per_reuse`` writes."""
    policy = admission.AdaptivePolicy(FrequencySketch(1 << 18), _signal(tier_bytes, tier_bytes))
    again = _sampled_keys(groups, seed=17)
    once = _sampled_keys(groups * once_per_reuse, seed=18)
    for i, k in enumerate(again):
        policy.admit([k])
        policy.seen([k])
        policy.admit(once[i * once_per_reuse:(i + 1) * once_per_reuse])
    policy.update()
    return policy


def test_writing_everything_must_earn_its_cost_in_hits_per_write_it_adds() -> None:
    # 0.08 of a hit per write by default: a hit per 5 added writes pays,
    # a hit per 20 does not.
    pays = _reuse_among_one_timers(5, 20)
    assert pays.threshold == 1
    assert pays.hits_write_all - pays.hits_gated == 20
    assert pays.writes_write_all - pays.writes_gated == 100
    costs = _reuse_among_one_timers(20, 20)
    assert costs.threshold == 2
    assert costs.hits_write_all - costs.hits_gated == 20
    assert costs.writes_write_all - costs.writes_gated == 400


def test_hits_and_writes_halve_together() -> None:
    # One update over many halvings (a probe that fell behind; miniatures of
    # 10 blocks, halved every 80 sampled sightings): the hits gained per
    # write added stay what the traffic gives.
    for once_per_reuse, threshold in ((5, 1), (20, 2)):
        policy = _reuse_among_one_timers(once_per_reuse, 400, tier_bytes=160_000)
        gain = policy.hits_write_all - policy.hits_gated
        added = policy.writes_write_all - policy.writes_gated
        assert gain < 40 and added < 40 * once_per_reuse  # halved many times
        assert gain / added == pytest.approx(1 / once_per_reuse, rel=0.15)
        assert policy.threshold == threshold


def test_the_miniatures_choose_the_gate_when_one_time_blocks_would_flush_the_tier() -> None:
    policy = admission.AdaptivePolicy(FrequencySketch(1 << 16), _signal(2_560_000, 2_560_000))
    hot, cold = _sampled_keys(100, seed=13), _sampled_keys(4000, seed=14)
    stream = []
    for i in range(40):  # the hot blocks come back every 200 sightings, among one-timers
        stream += hot + cold[i * 100:(i + 1) * 100]
    _run(policy, stream)
    assert policy.hits_gated > 1.25 * policy.hits_write_all
    assert policy.threshold == 2
    # ... and back to writing everything when the workload changes.
    _run(policy, [k for i in range(0, 4000, 50)
                  for k in (_sampled_keys(50, seed=100 + i) * 2)])
    assert policy.threshold == 1


def test_the_probe_thread_refreshes_and_stops_on_close() -> None:
    readings = []

    def usage() -> tuple[int, int]:
        readings.append(1)
        return 0, 10**9

    sig = admission.CapacitySignal(usage, None, _Writes(), 10)
    policy = admission.AdaptivePolicy(FrequencySketch(1 << 10), sig)
    policy.start(0.001)
    probe = policy._probe
    assert probe is not None
    probe._stop.wait(0.2)  # let it run a few rounds (no assertion on how many)
    policy.close()
    assert not probe._thread.is_alive() and readings
    policy.close()  # a second close is a no-op


def test_sampling_and_estimate_twins_agree() -> None:
    native_mod = pytest.importorskip("kvstore_tiers._sketch")
    keys = make_keys(500, seed=15) + _xxhash_keys(300, seed=16)
    tables = []
    for offer, increment in ((native_mod.offer, native_mod.increment),
                             (sketch._offer_py, sketch._increment_py)):
        s = FrequencySketch(1 << 8)
        t, m = s.table, s.mask
        seen: list[bytes | int] = []
        increment(t, keys * 2, m, 16, seen)
        offered: list[bytes | int] = []
        admitted = offer(t, keys[:50], m, 4, 16, offered)
        tables.append((bytes(t), seen, offered, admitted))
        # Every sampled key, each with its count after that sighting.
        assert seen[0::2] == [k for k in keys * 2 if k[-5] < 16]
        assert any(len(k) == 20 for k in seen[0::2])  # type: ignore[arg-type]
        assert offered[1::2] == [s.estimate(k) for k in offered[0::2]]  # type: ignore[arg-type]
        nothing: list[bytes | int] = []
        increment(t, keys[:3], m, 0, nothing)  # limit 0: none sampled
        assert offer(t, keys[:3], m, 1, 16, None) is None and nothing == []
        with pytest.raises(ValueError):
            increment(t, [b"short"], m, 16, nothing)
    assert tables[0] == tables[1]
    t, m = FrequencySketch(1 << 8).table, (1 << 8) - 1
    native_mod.increment(t, keys, m)
    assert [native_mod.estimate(t, k, m) for k in keys] == [
        sketch._estimate_py(t, k, m) for k in keys]


def test_a_full_samples_list_takes_no_more() -> None:
    native_mod = pytest.importorskip("kvstore_tiers._sketch")
    keys = [k for k in make_keys(2000, seed=17) if k[-5] < 16]
    t, m = FrequencySketch(1 << 10).table, (1 << 10) - 1
    full = [b"x"] * sketch.SAMPLES_MAX
    native_mod.increment(t, keys, m, 16, full)
    sketch._increment_py(t, keys, m, 16, full)
    assert len(full) == sketch.SAMPLES_MAX
