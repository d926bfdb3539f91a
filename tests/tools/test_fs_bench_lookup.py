"""The fs bench drives lookups as vLLM's scheduler does, so its load windows time transfers."""

from __future__ import annotations

from typing import Any

import pytest

from kvstore_tiers.plugin import register
from kvstore_tiers.tools.bench import fs_bench


@pytest.mark.parametrize("kind", list(fs_bench.TIERS))
def test_a_load_round_promotes_each_request_as_one_job(tmp_path, monkeypatch, kind) -> None:
    # vLLM's scheduler scans a request's keys past a RETRY, so one step starts
    # every async lookup and the next one's promotions are one job per request.
    # The bench's loop once stopped at the first RETRY: one-chunk jobs, one per
    # step, and load windows that timed lookups.
    register()
    sizes: list[int] = []
    real_build = fs_bench.build_harness

    def build(*a: Any, **kw: Any) -> Any:
        h = real_build(*a, **kw)
        tier = h.tiers[0]
        submit_load = tier.submit_load

        def counting(job: Any) -> None:
            sizes.append(len(job.keys))
            submit_load(job)

        tier.submit_load = counting
        return h

    monkeypatch.setattr(fs_bench, "build_harness", build)
    _gbps, keys, _cpu, _io_cpu = fs_bench.store_round(kind, tmp_path, 64 * 1024, 32, 4, seed=1)
    assert sizes == []
    _gbps, _steps, lookup_steps, _cpu, _io_cpu = fs_bench.load_round(
        kind, tmp_path, 64 * 1024, keys, 4)
    assert sorted(sizes) == [8, 8, 8, 8]
    assert lookup_steps <= 10
