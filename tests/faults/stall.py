"""A tier whose loads or stores block on an Event: a backend stuck in I/O, on demand.

Configured through vLLM's ``module_path`` route::

    {"type": "StallFsTier", "module_path": "tests.faults.stall", "root_dir": ...}
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from kvstore_tiers.backends.base import Read, ReadDone, Write, Written
from kvstore_tiers.backends.fs import FileSystemBackend
from kvstore_tiers.tier import KVStoreTier


class StallFsBackend(FileSystemBackend):
    """fs backend whose loads (``read_many``, every load batch) wait for
    ``gate``, whose stores (``write_many``) wait for ``store_gate`` and whose
    existence checks wait for ``exists_gate`` (all open by default)."""

    gate = threading.Event()
    #: Set when a load is stuck at the gate.
    stalled = threading.Event()
    store_gate = threading.Event()
    #: Set when a store is stuck at its gate.
    store_stalled = threading.Event()
    #: Existence checks (``exists_many``, a lookup's question to the store) wait here.
    exists_gate = threading.Event()
    exists_stalled = threading.Event()

    def exists_many(self, names: Sequence[str]) -> list[bool]:
        _pass(self.exists_gate, self.exists_stalled)
        return super().exists_many(names)

    def write_many(self, writes: Sequence[Write]) -> list[Written]:
        _pass(self.store_gate, self.store_stalled)
        return super().write_many(writes)

    def read_many(self, reads: Sequence[Read]) -> list[ReadDone]:
        _pass(self.gate, self.stalled)
        return super().read_many(reads)


def _pass(gate: threading.Event, stalled: threading.Event) -> None:
    """Wait at ``gate`` (30 s at most), setting ``stalled`` if it is closed."""
    if not gate.is_set():
        stalled.set()
        gate.wait(30)


StallFsBackend.gate.set()
StallFsBackend.store_gate.set()
StallFsBackend.exists_gate.set()


class StallFsTier(KVStoreTier):
    backend_cls = StallFsBackend

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
