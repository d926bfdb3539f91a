"""The load trace (``KVSTORE_TIERS_LOAD_TRACE``): off by default, and on, one
record per load job with its phases in the order a load passes them, through
vLLM's real manager."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from vllm.v1.kv_offload.base import LookupResult

from kvstore_tiers.admin.harness import build_harness, make_keys
from kvstore_tiers.loadtrace import LOAD_TRACE_ENV

from ..conftest import rows_like

ROW = 16 * 1024


def _tier(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {"type": "fs", "root_dir": str(tmp_path / "root"), "n_read_threads": 4, **extra}


def _store_then_load(h: Any, jobs: list[list[bytes]]) -> None:
    """Store every job's keys, forget the primary, load each job back as its own
    request, check the bytes."""
    rows = [rows_like(len(keys), ROW, seed=i) for i, keys in enumerate(jobs)]
    for keys, r in zip(jobs, rows, strict=True):
        h.store_all(keys, r)
    h.forget_primary()
    for keys, r in zip(jobs, rows, strict=True):
        ctx = h.new_request()
        results, _ = h.lookup_until_resolved(keys, ctx)
        assert results == [LookupResult.HIT] * len(keys)
        assert np.array_equal(h.load(keys, ctx), r)
        h.finish_request(ctx)


def test_off_by_default_nothing_is_traced(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(LOAD_TRACE_ENV, raising=False)
    h = build_harness([_tier(tmp_path)], num_chunks=32, chunk_bytes=ROW)
    try:
        tier = h.tiers[0]
        assert tier.load_trace is None
        _store_then_load(h, [make_keys(8, seed=1)])
    finally:
        h.shutdown()
    assert [p.name for p in tmp_path.iterdir()] == ["root"]


@pytest.mark.parametrize("deadline", [None, 30.0], ids=["direct", "bounce-buffer"])
def test_each_load_job_is_one_record_with_its_phases_in_order(tmp_path, monkeypatch,
                                                              deadline) -> None:
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv(LOAD_TRACE_ENV, str(path))
    extra = {"load_timeout_s": deadline} if deadline else {}
    h = build_harness([_tier(tmp_path, **extra)], num_chunks=32, chunk_bytes=ROW)
    jobs = [make_keys(16, seed=2), make_keys(5, seed=3)]
    try:
        assert h.tiers[0].load_trace is not None
        _store_then_load(h, jobs)
        assert not path.exists()  # nothing written while the tier runs
    finally:
        h.shutdown()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    # Loads only (the two store jobs are not traced), in submit order.
    assert [r["chunks"] for r in records] == [16, 5]
    for rec in records:
        assert rec["tier"] == "fs" and rec["pid"] == os.getpid() and rec["ok"] is True
        slots = sorted(s for b in rec["batches"] for s in range(*b["slots"]))
        assert slots == list(range(rec["chunks"]))  # every slot in exactly one batch
        for b in rec["batches"]:
            assert b["thread"].startswith("kvstore_")  # an I/O thread, never the scheduler's
            stages = [m[0] for m in b["marks"]]
            n = b["slots"][1] - b["slots"][0]
            assert stages == ["read", "read_end"] + ["frame"] * n
            times = [rec["submit"], b["start"], b["call"], *(m[1] for m in b["marks"]),
                     b["call_end"], b["end"], rec["published"], rec["picked"]]
            assert times == sorted(times), b
        assert max(b["end"] for b in rec["batches"]) <= rec["published"] <= rec["picked"]
    assert records[0]["picked"] <= records[1]["submit"]  # one request after the other


def test_a_flush_writes_the_jobs_picked_up_and_shutdown_the_rest(tmp_path, monkeypatch) -> None:
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv(LOAD_TRACE_ENV, str(path))
    h = build_harness([_tier(tmp_path)], num_chunks=32, chunk_bytes=ROW)
    try:
        _store_then_load(h, [make_keys(4, seed=4)])
        assert h.tiers[0].load_trace.flush() == 1
        assert h.tiers[0].load_trace.flush() == 0  # nothing new
        _store_then_load(h, [make_keys(6, seed=5)])
    finally:
        h.shutdown()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["chunks"] for r in records] == [4, 6]
    assert len({r["job"] for r in records}) == 2


def test_a_trace_file_in_a_missing_directory_fails_the_start_naming_the_variable(
        tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(LOAD_TRACE_ENV, str(tmp_path / "no-such-dir" / "trace.jsonl"))
    with pytest.raises(Exception, match=LOAD_TRACE_ENV):
        build_harness([_tier(tmp_path)], num_chunks=8, chunk_bytes=ROW)
