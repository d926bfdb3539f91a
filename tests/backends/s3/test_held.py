"""HeldBodies: the bytes an existence check's GETs hold for their loads, bounded and dated."""

from __future__ import annotations

import time

import pytest

from kvstore_tiers.backends.s3 import held as held_mod
from kvstore_tiers.backends.s3.held import HeldBodies


def test_reserve_hold_take_counts_bytes() -> None:
    h: HeldBodies[bytes] = HeldBodies(100, hold_s=60)
    assert h.room_for(5) == 5  # no size seen yet: all of them may be tried
    assert h.reserve(40) and h.reserve(40)
    assert not h.reserve(40)  # 120 > 100: not read
    assert h.nbytes == 80 and h.room_for(5) == 0
    h.hold("a", b"x" * 40, 40)
    h.release(40)  # the other's read failed
    assert h.nbytes == 40 and h.room_for(5) == 1
    assert h.take("a") == b"x" * 40
    assert h.take("a") is None and h.nbytes == 0


def test_disabled_holds_nothing() -> None:
    h: HeldBodies[bytes] = HeldBodies(0, hold_s=60)
    assert not h.enabled and h.room_for(3) == 0 and not h.reserve(1)


def test_expired_bodies_are_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(held_mod.time, "monotonic", lambda: now[0])
    dropped: list[bytes] = []
    h: HeldBodies[bytes] = HeldBodies(100, hold_s=10, on_drop=dropped.append)
    for key in ("a", "b"):
        assert h.reserve(30)
        h.hold(key, key.encode() * 30, 30)
        now[0] += 6
    # a expired (held at 1000, now 1012), b not (1006 + 10 > 1012).
    assert h.take("a") is None and dropped == [b"a" * 30]
    assert h.reserve(30)  # expiry makes room too
    now[0] += 10
    assert h.reserve(30) and dropped == [b"a" * 30, b"b" * 30] and h.nbytes == 60


def test_holding_a_key_again_replaces_it() -> None:
    dropped: list[bytes] = []
    h: HeldBodies[bytes] = HeldBodies(100, hold_s=60, on_drop=dropped.append)
    assert h.reserve(10)
    h.hold("a", b"1" * 10, 10)
    assert h.reserve(10)
    h.hold("a", b"2" * 10, 10)
    assert dropped == [b"1" * 10] and h.nbytes == 10 and h.take("a") == b"2" * 10


def test_sweep_drops_what_outlived_its_hold_with_no_later_call() -> None:
    """What the backend's timer calls: no lookup or load needs to come for a body past
    its time to go, and its bytes with it."""
    dropped: list[bytes] = []
    h: HeldBodies[bytes] = HeldBodies(100, hold_s=0.05, on_drop=dropped.append)
    assert h.reserve(40)
    h.hold("k", b"x" * 40, 40)
    h.sweep()
    assert h.nbytes == 40 and not dropped  # not yet
    time.sleep(0.06)
    h.sweep()
    assert h.nbytes == 0 and len(h) == 0 and dropped == [b"x" * 40]
