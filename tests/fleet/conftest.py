"""The fleet tests' fabric fixture, and their timelines printed at the end of the run."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.netns import Fabric, require_netns

#: Lines of text per test, printed in the terminal summary.
TIMELINES: dict[str, list[str]] = {}
#: If set, the timelines are also written there as JSON.
REPORT_ENV = "KVSTORE_FLEET_REPORT"
REPORTS: dict[str, Any] = {}


@pytest.fixture
def fabric() -> Iterator[Fabric]:
    """A server namespace with a bridge; the test adds hosts. Torn down whatever happens."""
    require_netns()
    with Fabric() as f:
        yield f


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not TIMELINES:
        return
    tr = terminalreporter
    tr.section("kvstore fleet partition timeline (seconds from the cut)")
    for lines in TIMELINES.values():
        for line in lines:
            tr.write_line(line)
    path = os.environ.get(REPORT_ENV)
    if path:
        with open(path, "w") as f:
            json.dump(REPORTS, f, indent=2)
