"""Fixtures of the plugin tests: the kvstore-memory plugin installed out of the venv."""

from __future__ import annotations

from pathlib import Path

import pytest

from .plugin_helpers import install_plugin


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the installed plugin (put it on a child's PYTHONPATH)."""
    return install_plugin(tmp_path_factory.mktemp("kvstore-memory"))
