"""One completion protocol: every finished pool job settles itself into the
tier's ledger, and the tier reports what it returns, whatever the job's class."""

from __future__ import annotations

import time
from typing import Any

from vllm.v1.kv_offload.tiering.base import JobResult

from kvstore_tiers.pool import PoolJob

ROW = 4096


class _Settling(PoolJob):
    """A job the tier has never heard of: it reports one result of its own."""

    __slots__ = ("ledgers",)

    def __init__(self, job_id: int) -> None:
        super().__init__(job_id, 1)
        self.ledgers: list[Any] = []

    def run(self, ctx: Any, start: int, stop: int) -> None:
        return

    def cancel(self, start: int, stop: int) -> None:
        return

    def settle(self, ledger: Any) -> JobResult:
        self.ledgers.append(ledger)
        return JobResult(job_id=self.job_id, success=True)


def test_a_job_of_any_class_settles_itself_once(harness_factory, tmp_path) -> None:
    h = harness_factory([{"type": "fs", "root_dir": str(tmp_path)}], num_chunks=4,
                        chunk_bytes=ROW)
    tier = h.tiers[0]
    job = _Settling(4242)
    assert tier.pool.submit(job, is_load=False)
    results: list[JobResult] = []
    deadline = time.monotonic() + 10
    while not results and time.monotonic() < deadline:
        results = list(tier.get_finished_jobs())
        time.sleep(0.005)
    assert [(r.job_id, r.success) for r in results] == [(4242, True)]
    assert job.ledgers == [tier._ledger]
    assert not list(tier.get_finished_jobs())  # settled once, reported once
