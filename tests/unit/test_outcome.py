"""What a finished job's per-slot outcomes condense to (kvstore_tiers.outcome)."""

from __future__ import annotations

from kvstore_tiers.errors import TransientError
from kvstore_tiers.outcome import NOT_WRITTEN, Summary


def test_a_slot_not_written_is_neither_stored_nor_failed() -> None:
    """A store slot its runner chose not to write joins ``unwritten`` (it leaves the
    presence index), as a store filter's skip does; the job's own list is not changed."""
    declined = [b"d"]
    s = Summary.of([b"a", b"b", b"c"], [True, NOT_WRITTEN, TransientError("x")], [10, 0, 0],
                   False, declined)
    assert s.ok == [b"a"] and s.bad == [b"c"] and s.unwritten == [b"d", b"b"]
    assert (s.written, s.frame_bytes, s.transient) == (1, 10, 1)
    assert declined == [b"d"]


def test_every_slot_written_keeps_the_fast_path() -> None:
    s = Summary.of([b"a", b"b"], [True, True], [3, 4], False)
    assert s.ok == [b"a", b"b"] and s.unwritten == () and s.written == 2
