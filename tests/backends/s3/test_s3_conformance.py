"""The backend conformance suite against a real moto S3 server (a fresh bucket per test)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvstore_tiers.backends.s3 import S3Backend
from kvstore_tiers.backends.s3.config import as_config
from kvstore_tiers.namespace import Namespace
from kvstore_tiers.testing.backend import BackendTests


class TestS3(BackendTests):
    @pytest.fixture(autouse=True)
    def _bucket(self, tier_config: Callable[..., dict[str, Any]]) -> None:
        self.config = tier_config()

    def make_backend(self, namespace: Namespace, tmp_path: Path) -> S3Backend:
        return S3Backend(as_config(self.config), namespace)
