"""Scale: presence index memory, bounded queue, and a compressed soak (no growth)."""

from __future__ import annotations

import os
import threading
import time
import tracemalloc
from pathlib import Path

from kvstore_tiers.admin.harness import make_keys
from kvstore_tiers.presence import PresenceIndex

from .common import HIT, Driver, rows_for

#: Documented bound (docs/internals/fault-matrix.md): bytes per remembered key.
PRESENCE_BYTES_PER_KEY = 200


def test_presence_index_of_a_million_keys_stays_within_bound() -> None:
    n = 1_000_000
    keys = [i.to_bytes(32, "little") + b"\0\0\0\0" for i in range(n)]  # 36-byte OffloadKeys
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        idx = PresenceIndex(n)
        for k in keys:
            idx.add(k)
        used = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    keys_bytes = n * (36 + 33)  # the key objects themselves (bytes header + payload)
    print(f"presence index: {used / n:.0f} B/key for the index, "
          f"{(used + keys_bytes) / n:.0f} B/key with the keys")
    assert len(idx) == n
    assert used + keys_bytes <= n * PRESENCE_BYTES_PER_KEY
    idx.add(b"x" * 36)  # past capacity the oldest key is forgotten
    assert len(idx) == n and keys[0] not in idx


def test_queue_is_bounded(tmp_path: Path) -> None:
    """More chunks than max_queued_chunks in flight: jobs fail, memory does not grow."""
    d = Driver("fs", [{"type": "fs", "root_dir": str(tmp_path), "max_queued_chunks": 64,
                       "n_read_threads": 1, "n_write_threads": 1}],
               num_chunks=256, chunk_bytes=4096)
    try:
        tier = d.tier
        keys = make_keys(10_000, seed=71)
        rows = rows_for(keys[:256], 4096)
        peak = 0
        for i in range(0, 10_000, 256):
            batch = keys[i : i + 256]
            ctx = d.call(d.h.new_request)
            d.call(d.h.store, batch, rows[: len(batch)], ctx)
            peak = max(peak, tier.pool.queued_chunks)
            d.settle()
            d.call(d.h.finish_request, ctx)
        assert peak <= 64
        c = tier.counters
        assert c.objects_stored + c.stores_dropped >= 10_000 - c.objects_skipped
    finally:
        assert d.close() == 0


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_soak_store_load_cycles_do_not_grow(tmp_path: Path) -> None:
    """4000 blocks stored and 4000 loaded back through vLLM's manager, 8 per round."""
    d = Driver("fs", [{"type": "fs", "root_dir": str(tmp_path), "presence_capacity": 1000}],
               num_chunks=8, chunk_bytes=4096)
    tracemalloc.start()
    try:
        marks: dict[int, tuple[int, int, int]] = {}
        prev: list[bytes] = []
        start = time.monotonic()
        for r in range(500):
            keys = make_keys(8, seed=10_000 + r)
            d.store(keys, rows_for(keys, 4096))  # evicts the previous round from the primary
            if prev:
                assert d.fetch(prev) == [HIT] * 8
                for k in prev:
                    d.expected.pop(k)
            prev = keys
            if r in (100, 499):
                marks[r] = (threading.active_count(), _fds(), tracemalloc.get_traced_memory()[0])
        took = time.monotonic() - start
    finally:
        tracemalloc.stop()
        assert d.close() == 0
    (t0, f0, m0), (t1, f1, m1) = marks[100], marks[499]
    print(f"soak: 500 rounds in {took:.1f}s; threads {t0}->{t1}, fds {f0}->{f1}, "
          f"traced memory {m0 / 1e6:.2f}->{m1 / 1e6:.2f} MB")
    assert t1 <= t0 and f1 <= f0
    assert m1 - m0 < 1_000_000  # no growth beyond noise (presence capped at 1000 keys)
    assert d.score.wrong_bytes == 0
