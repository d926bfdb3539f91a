"""The presence index: stored vs in-flight keys, receipts, and forgetting the oldest."""

from __future__ import annotations

from kvstore_tiers.admin.harness import make_keys
from kvstore_tiers.presence import PresenceIndex, new_receipt, settle


def test_keys_of_a_store_are_in_flight_until_its_receipt_is_settled() -> None:
    idx = PresenceIndex(100)
    keys = make_keys(4)
    receipt = new_receipt()
    idx.update(keys, receipt)
    assert all(k in idx for k in keys)  # a second store of them is skipped
    assert not any(idx.stored(k) for k in keys)  # but lookups do not hit yet
    settle(receipt)
    settle(receipt)  # idempotent
    assert all(idx.stored(k) for k in keys)
    assert not idx.stored(b"unknown")
    assert not new_receipt()  # every receipt starts unsettled


def test_a_failed_store_forgets_only_keys_still_owned_by_its_receipt() -> None:
    idx = PresenceIndex(100)
    keys = make_keys(3)
    first, second = new_receipt(), new_receipt()
    idx.update(keys, first)
    idx.update(keys[2:], second)  # keys[2] now belongs to a later store
    idx.discard_receipt(keys, first)
    assert keys[0] not in idx and keys[1] not in idx
    assert idx.get(keys[2]) is second


def test_forget_says_whether_a_key_was_stored_in_flight_or_not_held() -> None:
    idx = PresenceIndex(100)
    found, done, pending = make_keys(3)
    receipt, open_receipt = new_receipt(), new_receipt()
    idx.add(found)
    idx.update([done], receipt)
    idx.update([pending], open_receipt)
    settle(receipt)
    assert idx.forget(found) is True
    assert idx.forget(done) is True
    assert idx.forget(pending) is False
    assert idx.forget(found) is None  # no longer held
    assert not idx


def test_keys_added_as_found_are_stored_at_once() -> None:
    idx = PresenceIndex(100)
    (key,) = make_keys(1)
    idx.add(key)
    assert idx.stored(key)
    idx.discard(key)
    assert key not in idx and not idx.stored(key)


def test_past_capacity_the_oldest_insertions_are_forgotten() -> None:
    idx = PresenceIndex(10)
    keys = make_keys(25, seed=1)
    for i in range(0, 25, 5):
        idx.update(keys[i : i + 5])
    assert list(idx) == keys[15:]
    # Churn with discards and re-insertions keeps the index and its FIFO bounded.
    for _ in range(100):
        for k in keys:
            idx.discard(k)
            idx.add(k)
    assert len(idx) <= 10 and len(idx._fifo) <= 10
    assert all(idx.stored(k) for k in idx)


def test_capacity_zero_remembers_nothing() -> None:
    idx = PresenceIndex(0)
    idx.update(make_keys(3), new_receipt())
    idx.add(b"k")
    assert len(idx) == 0
