"""Fixtures of the fault matrix, and the summary table printed at the end of the run.

The s3 and redis server fixtures come from tests/servers.py (through
tests/conftest.py), not duplicated.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

from .common import SCORES


@pytest.fixture(scope="session", autouse=True)
def _freeze_gc() -> Iterator[None]:
    """Move the (huge) import-time heap out of the collector's sight.

    A full collection over vLLM's imported objects takes ~0.5 s on this
    machine and would land inside some timed scheduler call, counting a
    "blocked step" that no tier caused.
    """
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


#: If set, the summary is also written there as JSON (docs/internals/fault-matrix.md uses it).
REPORT_ENV = "KVSTORE_FAULT_REPORT"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not SCORES:
        return
    tr = terminalreporter
    tr.section("kvstore fault matrix")
    cols = ("backend", "faults", "wrong_bytes", "exceptions", "blocked>50ms", "leaks",
            "rows_verified", "calls", "max_call", "max_tier_call")
    tr.write_line(" | ".join(f"{c:>12}" for c in cols))
    for name in sorted(SCORES):
        s = SCORES[name]
        vals = (name, s.faults, s.wrong_bytes, s.exceptions, s.blocked, s.leaks,
                s.rows_verified, s.calls, s.max_call.text, s.max_tier.text)
        tr.write_line(" | ".join(f"{v!s:>12}" for v in vals))
    for name in sorted(SCORES):
        kinds = ", ".join(f"{k}={v}" for k, v in sorted(SCORES[name].kinds.items()))
        tr.write_line(f"{name}: {kinds}")
    path = os.environ.get(REPORT_ENV)
    if path:
        with open(path, "w") as f:
            json.dump({n: {**dataclasses.asdict(s), "kinds": dict(s.kinds)}
                       for n, s in SCORES.items()}, f, indent=2)
