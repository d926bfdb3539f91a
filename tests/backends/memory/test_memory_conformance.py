"""The kvstore-memory plugin's backend passes the backend conformance suite."""

from __future__ import annotations

from pathlib import Path

from kvstore_tiers.backends.base import Backend
from kvstore_tiers.namespace import Namespace
from kvstore_tiers.testing.backend import BackendTests

from ...plugins.plugin_helpers import load_backend_module


class TestMemoryBackend(BackendTests):
    def make_backend(self, namespace: Namespace, tmp_path: Path) -> Backend:
        mod = load_backend_module()
        return mod.MemoryBackend(mod.MemoryConfig(max_bytes=256 << 20), namespace)
