"""A far server's GET window: a connection's share of the bandwidth-delay product.

What a user needs from it: a fresh engine's first load from a far server asks for
what a fast link carries in a round trip (a GET held back short of that costs a
round trip), a later load for what the path was measured to carry, and a near
server never more than NEAR_WINDOW_BYTES per connection (deeper, redis-server builds
replies in fresh memory faster than they are read). The arithmetic runs on a clock
of the test's own; the rate a real load measures is checked on a real redis-server
behind the delaying proxy.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import redis.exceptions as rexc

from kvstore_tiers.admin.harness import make_keys
from kvstore_tiers.backends.redis import fastio
from kvstore_tiers.backends.redis.fastio import (
    BDP_GAIN,
    NEAR_WINDOW_BYTES,
    PRIOR_RATE_BPS,
    RATE_MIN_BYTES,
    FastIO,
)
from kvstore_tiers.tools.netem.delay import delay_proxy

from ...conftest import rows_like as random_rows
from ...servers import RedisServer

MiB = 1 << 20
#: A 1 MiB block's value: its frame, the row and a header (3 to NEAR_WINDOW_BYTES).
VALUE = MiB + 64
NEAR = NEAR_WINDOW_BYTES // VALUE


class Clock:
    """time.perf_counter and time.sleep for FastIO, moved by the test."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(fastio, "time", c)
    return c


def far(rtt_s: float = 0.05) -> FastIO:
    return FastIO(pool=None, retries=0, backoff=lambda _: 0.0, rtt_s=rtt_s)


def busy_period(f: FastIO, clock: Clock, batches: list[int], took_s: float) -> None:
    """Batches in flight together for ``took_s``, each reading the bytes given."""
    for _ in batches:
        f._busy_began()
    clock.now += took_s
    for got in batches:
        f._busy_ended(got)


def test_a_near_server_keeps_the_near_window() -> None:
    f = far(rtt_s=0.0002)
    assert not f.far
    assert NEAR == 3
    assert f.window(8, VALUE, 8) == NEAR
    assert f.window(8, 16 << 10, 8) == 8  # small values: the whole batch fits 4 MiB
    assert f.window(2, VALUE, 1) == 2  # never more than the batch


def test_a_fresh_far_server_gets_the_prior_rates_share() -> None:
    """Before any load measured the path, it is taken to carry PRIOR_RATE_BPS, shared
    by the load threads: 1.5 x 50 ms x 1.25 GB/s / 8 is 11.2 values of 1 MiB, so
    whole pipelines of 8; at 20 ms 4.5, so 5; at 5 ms 1.1, so the near window."""
    assert PRIOR_RATE_BPS == 1.25e9 and BDP_GAIN == 1.5
    for rtt, want in ((0.05, 8), (0.02, 5), (0.005, NEAR)):
        f = far(rtt_s=rtt)
        assert f.far
        assert f.window(8, VALUE, 8) == want, rtt


def test_a_measured_rate_sets_the_next_loads_window(clock: Clock) -> None:
    f = far(rtt_s=0.05)
    # 8 batches of 8 MiB in 0.55 s: 64 MiB over 0.5 s (one round trip carries nothing)
    busy_period(f, clock, [8 * MiB] * 8, 0.55)
    assert list(f._rate_Bps) == []  # recorded when the next load starts
    clock.now += 1.0
    f._busy_began()
    [rate] = f._rate_Bps
    assert rate == pytest.approx(64 * MiB / 0.5)
    # 1.5 x 0.05 s x 134 MB/s over 8 batches: 1.2 values, under the near window
    assert f.window(8, VALUE, 8) == NEAR
    # shared by 2 batches only, each carries 4x as much in a round trip: 4.8
    assert f.window(8, VALUE, 2) == 5


def test_batches_less_than_a_round_trip_apart_are_one_busy_period(clock: Clock) -> None:
    """A load thread taking its next batch leaves a gap far under a round trip: its
    batches and the ones after it are one load, and their rate is one rate."""
    f = far(rtt_s=0.05)
    busy_period(f, clock, [8 * MiB], 0.1)
    clock.now += 0.001
    busy_period(f, clock, [8 * MiB], 0.1)
    clock.now += 1.0
    f._busy_began()
    [rate] = f._rate_Bps
    assert rate == pytest.approx(16 * MiB / (0.201 - 0.05))


def test_a_gap_of_a_round_trip_starts_a_new_busy_period(clock: Clock) -> None:
    f = far(rtt_s=0.05)
    busy_period(f, clock, [16 * MiB], 0.15)
    clock.now += 0.04  # under the round trip: the same period goes on
    busy_period(f, clock, [16 * MiB], 0.15)
    clock.now += 0.06  # over it: the next batch starts a new one
    busy_period(f, clock, [16 * MiB], 0.15)
    clock.now += 1.0
    f._busy_began()
    assert list(f._rate_Bps) == [pytest.approx(32 * MiB / (0.34 - 0.05)),
                                 pytest.approx(16 * MiB / (0.15 - 0.05))]


def test_small_or_failed_periods_measure_no_rate(clock: Clock) -> None:
    f = far(rtt_s=0.05)
    busy_period(f, clock, [RATE_MIN_BYTES - 1], 0.2)  # a small load: its round trips
    clock.now += 1.0
    busy_period(f, clock, [32 * MiB, -1], 0.2)  # a batch failed: its time says nothing
    clock.now += 1.0
    f._busy_began()
    assert list(f._rate_Bps) == []
    assert f.window(8, MiB, 8) == 8  # still the prior's


def test_the_window_takes_the_most_of_recent_rates(clock: Clock) -> None:
    """A load slowed by a busy machine does not shrink the next one's window: the
    window follows the most any recent busy period moved."""
    f = far(rtt_s=0.05)
    for took in (0.175, 2.05, 1.05):  # 64 MiB over 0.125, 2.0 and 1.0 s
        busy_period(f, clock, [64 * MiB], took)
        clock.now += 1.0
    f._busy_began()
    assert len(f._rate_Bps) == 3
    assert max(f._rate_Bps) == pytest.approx(64 * MiB / 0.125)
    # 1.5 x 0.05 x 537 MB/s / 8: 4.8 values of 1 MiB; over 2 batches, more than 8
    assert f.window(8, VALUE, 8) == 5
    assert f.window(8, VALUE, 2) == 8


class FakeConn:
    """A pooled connection whose server is the test: every GET sent is answered at once
    (a 3-byte value) on a socket pair, and the clock moves ``took_s`` per send."""

    def __init__(self, clock: Clock, fail: bool = False, took_s: float = 0.0) -> None:
        self._sock, self.peer = socket.socketpair()
        self.clock, self.fail, self.took_s = clock, fail, took_s
        self.sends: list[int] = []

    def send_packed_command(self, cmds: Sequence[bytes], check_health: bool = True) -> None:
        if self.fail:
            raise rexc.ConnectionError("connection reset by peer")
        n = b"".join(cmds).count(b"\r\nGET\r\n")
        self.sends.append(n)
        self.clock.now += self.took_s
        self.peer.sendall(b"$3\r\nabc\r\n" * n)

    def disconnect(self) -> None:
        pass

    def close(self) -> None:
        self._sock.close()
        self.peer.close()


class FakePool:
    def __init__(self, *conns: FakeConn) -> None:
        self.conns = list(conns)

    def get_connection(self, *_: Any) -> FakeConn:
        return self.conns.pop(0)

    def release(self, conn: FakeConn) -> None:
        pass


def get_batch(f: FastIO, n: int = 8) -> list[Any]:
    parts = [[memoryview(bytearray(VALUE))] for _ in range(n)]
    return f.get_many([b"k%d" % i for i in range(n)], parts, None)


def test_a_batch_sends_by_the_window_shared_by_the_batches_in_flight(clock: Clock) -> None:
    """At 5 ms, before a rate is measured: a lone batch gets the whole product (8.9
    values of 1 MiB: all 8 GETs at once); with another batch in flight, half (4.5: 5
    GETs first, the rest as replies are read); a fixed get_depth sends by itself."""
    lone, shared, fixed = FakeConn(clock), FakeConn(clock), FakeConn(clock)
    try:
        f = FastIO(FakePool(lone), retries=0, backoff=lambda _: 0.0, rtt_s=0.005)
        assert f.far
        assert get_batch(f) == [(3, 3, None)] * 8
        assert lone.sends == [8]
        f = FastIO(FakePool(shared), retries=0, backoff=lambda _: 0.0, rtt_s=0.005)
        f._busy_began()  # another batch of a load, in flight beside the next one
        assert get_batch(f) == [(3, 3, None)] * 8
        # then 3 more, 1 as each reply is read: the socket pair's first byte came in
        # no time, so the round trip the window covers is none (the near window)
        assert shared.sends == [5, 1, 1, 1]
        g = FastIO(FakePool(fixed), retries=0, backoff=lambda _: 0.0, get_depth=2,
                   rtt_s=0.005)
        assert get_batch(g) == [(3, 3, None)] * 8
        assert fixed.sends[0] == 2 and sum(fixed.sends) == 8
    finally:
        for c in (lone, shared, fixed):
            c.close()


@pytest.mark.parametrize("retried", [False, True], ids=["clean", "retried"])
def test_a_retried_batch_measures_no_rate(clock: Clock, monkeypatch: pytest.MonkeyPatch,
                                          retried: bool) -> None:
    """A batch that got its values on a second connection took its backoff's time, not
    the path's: its busy period records no rate (a clean one does: 24 bytes over 7
    sends of 50 ms less one round trip)."""
    monkeypatch.setattr(fastio, "RATE_MIN_BYTES", 1)
    conns = [FakeConn(clock, fail=True)] if retried else []
    conns.append(FakeConn(clock, took_s=0.05))
    try:
        f = FastIO(FakePool(*conns), retries=1, backoff=lambda _: 0.0, get_depth=2,
                   rtt_s=0.05)
        assert get_batch(f) == [(3, 3, None)] * 8
        assert conns[-1].sends == [2, 1, 1, 1, 1, 1, 1]  # 2, then one per reply read
        assert f._busy == 0
        clock.now += 1.0
        f._busy_began()
        assert list(f._rate_Bps) == ([] if retried else [pytest.approx(24 / (0.35 - 0.05))])
    finally:
        for c in conns:
            c.close()


def test_a_failed_batch_leaves_no_batch_in_flight_and_no_rate(
        clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fastio, "RATE_MIN_BYTES", 1)
    dropped = FakeConn(clock, fail=True)
    try:
        f = FastIO(FakePool(dropped), retries=0, backoff=lambda _: 0.0, rtt_s=0.05)
        f._busy_began()  # a batch beside it that will succeed
        with pytest.raises(rexc.ConnectionError):
            get_batch(f)
        assert f._busy == 1
        clock.now += 0.5
        f._busy_ended(32 * MiB)
        assert f._busy == 0
        clock.now += 1.0
        f._busy_began()
        assert list(f._rate_Bps) == []
    finally:
        dropped.close()


def test_a_real_load_at_distance_measures_its_rate(redis_server: RedisServer,
                                                   harness_factory: Any) -> None:
    """Two batches of 8 MiB, one after the other on one load thread, behind a 100 ms
    round trip (only a gap that long between them would split the load): one busy
    period, whose rate lies between its bytes over the wall time of the lookup and load
    and its bytes over one round trip (the batches wait one each, and the rate leaves
    one out)."""
    rtt_ms, n, row = 100, 16, MiB
    cfg = {"type": "redis", "url": redis_server.url, "compression": "none",
           "pipeline_batch": 8, "n_read_threads": 1, "n_write_threads": 1,
           "eviction_events": "off"}
    keys, rows = make_keys(n, seed=7), random_rows(n, row, seed=7)
    harness_factory([cfg], num_chunks=n, chunk_bytes=row).store_all(keys, rows)
    with delay_proxy(("127.0.0.1", redis_server.port), rtt_ms) as (host, port):
        h = harness_factory([{**cfg, "url": f"redis://{host}:{port}/0",
                              "socket_timeout_s": 10.0}], num_chunks=n, chunk_bytes=row)
        fast = h.tiers[0].backend._fast
        assert fast.far and fast.get_depth is None
        ctx = h.new_request()
        t0 = time.perf_counter()  # a resolved lookup may have started the load
        h.lookup_until_resolved(keys, ctx)
        assert np.array_equal(h.load(keys, ctx), rows)
        wall = time.perf_counter() - t0
        h.finish_request(ctx)
        h.forget_primary()
        time.sleep(3 * rtt_ms / 1000)  # closer loads would be one busy period
        ctx = h.new_request()
        h.lookup_until_resolved(keys, ctx)
        assert np.array_equal(h.load(keys, ctx), rows)  # records the first load's rate
        h.finish_request(ctx)
    rates = list(fast._rate_Bps)
    assert rates, "the first load measured no rate"
    moved = n * row
    assert moved / wall <= rates[0] <= moved / (0.9 * rtt_ms / 1000)
