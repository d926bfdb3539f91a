"""Fixtures of the tier's own tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .flaky import FlakyFsBackend


@pytest.fixture
def flaky() -> Iterator[type[FlakyFsBackend]]:
    """The flaky fs backend, healthy at the start and the end of each test."""
    FlakyFsBackend.reset()
    yield FlakyFsBackend
    FlakyFsBackend.reset()

