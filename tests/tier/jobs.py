"""Jobs handed straight to a harness's tier, as vLLM's manager hands them, and their results."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.tiering.base import TransferJob


def submit_stores(h: Any, jobs: list[tuple[int, list[bytes], list[int]]]) -> None:
    """Submit store jobs (id, keys, primary rows) straight to the tier, as vLLM does."""
    ctx = ReqContext(req_id="r1")
    with h.locked():
        for job_id, keys, cids in jobs:
            h.tiers[0].submit_store(TransferJob(job_id, keys, np.array(cids), False, ctx))


def results(h: Any, n: int) -> dict[int, Any]:
    """The next ``n`` results the tier reports, by job id."""
    tier, out = h.tiers[0], {}
    deadline = time.monotonic() + 30
    while len(out) < n and time.monotonic() < deadline:
        with h.locked():
            out.update((r.job_id, r) for r in tier.get_finished_jobs())
        time.sleep(0.005)
    assert len(out) == n
    return out
