"""The presence index: stored vs in-flight keys, receipts, and forgetting the oldest."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore_tiers.presence import PresenceIndex
from kvstore_tiers.tools.harness import make_keys


@dataclass
class StoreReceipt:
    """A store job as the index sees it (the tier passes the job itself)."""

    done: bool = False


def test_keys_of_a_store_are_in_flight_until_its_receipt_is_done() -> None:
    idx = PresenceIndex(100)
    keys = make_keys(4)
    receipt = StoreReceipt()
    idx.pend(keys, receipt)
    assert all(k in idx for k in keys)  # a second store of them is skipped
    assert not any(idx.stored(k) for k in keys)  # but lookups do not hit yet
    receipt.done = True
    assert all(idx.stored(k) for k in keys)
    assert not idx.stored(b"unknown")


def test_a_failed_store_forgets_only_keys_still_owned_by_its_receipt() -> None:
    idx = PresenceIndex(100)
    keys = make_keys(3)
    first, second = StoreReceipt(), StoreReceipt()
    idx.pend(keys, first)
    idx.pend(keys[2:], second)  # keys[2] now belongs to a later store
    idx.discard_receipt(keys, first)
    assert keys[0] not in idx and keys[1] not in idx
    assert idx.get(keys[2]) is second


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
    assert len(idx) <= 10 and idx._held <= 10 and len(idx._fifo) <= 10
    assert all(idx.stored(k) for k in idx)


def test_only_settled_keys_count_against_capacity() -> None:
    idx = PresenceIndex(4)
    stored, written, skipped = make_keys(3, seed=2), make_keys(3, seed=3), make_keys(8, seed=4)
    idx.update(stored)
    receipt = StoreReceipt()
    idx.pend(written + skipped, receipt)  # in flight: more than the capacity, all held
    assert all(k in idx for k in stored + written + skipped)
    receipt.done = True
    idx.discard_receipt(skipped, receipt)  # not written: they leave, taking no place
    idx.settle(written)  # written: they count now; the oldest batch goes, whole
    assert list(idx._fifo) == [written] and idx._held == 3
    assert set(idx) == set(written)
    assert all(idx.stored(k) for k in idx)


def test_a_settled_job_is_one_entry_and_its_keys_go_together() -> None:
    idx = PresenceIndex(10)
    jobs = [make_keys(4, seed=10 + i) for i in range(3)]
    for keys in jobs:
        idx.pend(keys, StoreReceipt(done=True))
        idx.settle(keys)
    # 12 keys past a capacity of 10: the oldest job's four go, not two of them.
    assert [list(b) for b in idx._fifo] == jobs[1:] and idx._held == 8
    assert set(idx) == set(jobs[1] + jobs[2])
    idx.settle([])  # a job that wrote nothing adds no entry
    assert len(idx._fifo) == 2


def test_capacity_zero_remembers_nothing() -> None:
    idx = PresenceIndex(0)
    keys = make_keys(3)
    idx.pend(keys, StoreReceipt())
    idx.settle(keys)
    idx.add(b"k")
    assert len(idx) == 0 and not idx._fifo
