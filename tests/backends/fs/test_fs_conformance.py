"""The fs backend passes the backend conformance suite, on both of its I/O paths."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore_tiers.backends.base import Backend
from kvstore_tiers.backends.fs import FileSystemBackend, FsConfig, fileio
from kvstore_tiers.namespace import Namespace
from kvstore_tiers.testing.backend import BackendTests


class TestFsBackend(BackendTests):
    """The compiled file calls where built (the pure-Python ones otherwise)."""

    def make_backend(self, namespace: Namespace, tmp_path: Path) -> Backend:
        return FileSystemBackend(FsConfig(root_dir=str(tmp_path / "store")), namespace)


class TestFsBackendPythonIO(TestFsBackend):
    """The pure-Python twins of the file calls."""

    @pytest.fixture(autouse=True)
    def _python_io(self, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
        for fn in ("publish_file", "publish_files", "read_files", "exists_files"):
            monkeypatch.setattr(fileio, fn, getattr(fileio, f"{fn}_py"))
        yield
