"""Load deadlines: a stuck backend never holds a request, and never writes a row late.

The backend blocks inside ``load_many`` (an Event), as a hung NFS read or a
stalled socket would. The load must be reported failed right after
``load_timeout_s`` from ``get_finished_jobs`` (no scheduler call blocks),
the request recomputes (MISS), and when the stuck thread finally returns
it must not write into the primary rows the job owned: they were freed and
reused by other blocks at once.
"""

from __future__ import annotations

import time
from pathlib import Path

from kvstore_tiers.admin.harness import make_keys

from .common import HIT, MISS, Driver, rows_for
from .stall import StallFsBackend


def test_stalled_load_fails_at_deadline_and_never_writes_late(tmp_path: Path) -> None:
    d = Driver("fs", [{"type": "StallFsTier", "module_path": "tests.faults.stall",
                       "root_dir": str(tmp_path), "load_timeout_s": 0.3,
                       "n_read_threads": 2, "n_write_threads": 1}],
               num_chunks=4, chunk_bytes=65536)
    gate = StallFsBackend.gate
    try:
        assert type(d.tier).__name__ == "StallFsTier"
        keys = make_keys(4, seed=21)
        d.store(keys, rows_for(keys, d.row_bytes))
        d.forget_primary()

        gate.clear()
        StallFsBackend.stalled.clear()
        d.score.fault("load_stall_past_deadline")
        start = time.monotonic()
        res = d.fetch(keys, max_wait_s=10)
        took = time.monotonic() - start
        assert res == [MISS] * 4
        assert StallFsBackend.stalled.is_set(), "the load never reached the backend"
        assert 0.3 <= took < 2.0, took
        assert d.tier.load_timeouts >= 1
        assert d.tier.counters.corrupt_objects == 0

        # The rows of the expired job are free again: other blocks take them.
        # (Every I/O thread is stuck in the backend, so their cascade to the
        # tier waits; the primary store itself does not.)
        d.reuse_expired_rows(seed=22, release=gate.set)
        assert d.score.wrong_bytes == 0
        # The stalled blocks are still fine for a later request.
        d.forget_primary()
        assert d.fetch(keys) == [HIT] * 4
    finally:
        gate.set()
        assert d.close() == 0


def test_lookup_until_resolved_gives_up_at_its_time_bound(tmp_path: Path,
                                                           harness_factory) -> None:
    """The harness's wait for a lookup is one bound in seconds, as settle's."""
    import pytest

    h = harness_factory([{"type": "StallFsTier", "module_path": "tests.faults.stall",
                          "root_dir": str(tmp_path)}], num_chunks=4, chunk_bytes=4096)
    gate = StallFsBackend.exists_gate
    gate.clear()
    StallFsBackend.exists_stalled.clear()
    try:
        ctx = h.new_request()
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"unresolved after 0.5 s"):
            h.lookup_until_resolved(make_keys(2, seed=5), ctx, timeout_s=0.5)
        assert 0.5 <= time.monotonic() - start < 5.0
        assert StallFsBackend.exists_stalled.is_set(), "the lookup never asked the store"
    finally:
        gate.set()
    assert h.lookup_until_resolved(make_keys(2, seed=5), ctx, timeout_s=30)[0] == [MISS] * 2
    h.finish_request(ctx)
