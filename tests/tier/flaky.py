"""An fs tier with faults on demand, for the tier's own rules (breaker, verdicts, drain).

Configured through vLLM's ``module_path`` route::

    {"type": "FlakyFsTier", "module_path": "tests.tier.flaky", "root_dir": ...}

* ``dead``: keys whose stores and loads fail with a TransientError, as the
  keys of one dead node of a cluster do while the rest are served;
* ``store_gate``: stores wait at it while it is clear (a write thread busy
  in I/O), so later jobs stay queued; ``store_stalled`` says one is waiting.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, ClassVar

from kvstore_tiers.backends.base import Read, ReadDone, Write, Written
from kvstore_tiers.backends.eviction_log import EvictionLog
from kvstore_tiers.backends.fs import FileSystemBackend
from kvstore_tiers.errors import TransientError
from kvstore_tiers.tier import KVStoreTier


class FlakyFsBackend(FileSystemBackend):
    dead: ClassVar[set[bytes]] = set()
    store_gate = threading.Event()
    store_stalled = threading.Event()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The tests hand over evictions here, as the fs evictor or a Redis
        # keyevent listener would.
        self.evictions = EvictionLog()

    @classmethod
    def reset(cls) -> None:
        cls.dead.clear()
        cls.store_stalled.clear()
        cls.store_gate.set()

    def _live(self, names: Sequence[str]) -> list[int]:
        """Indices of ``names`` whose keys are not in ``dead``."""
        dead = {self.namespace.object_name(k) for k in self.dead}  # type: ignore[attr-defined]
        return [i for i, n in enumerate(names) if n not in dead]

    def write_many(self, writes: Sequence[Write]) -> list[Written]:
        if not self.store_gate.is_set():
            self.store_stalled.set()
            self.store_gate.wait(30)
        live = self._live([w.name for w in writes])
        out: list[Written] = [TransientError("node down")] * len(writes)
        if live:
            for i, res in zip(live, super().write_many([writes[i] for i in live]), strict=True):
                out[i] = res
        return out

    def read_many(self, reads: Sequence[Read]) -> list[ReadDone]:
        live = self._live([r.name for r in reads])
        out: list[ReadDone] = [(i, TransientError("node down")) for i in range(len(reads))
                               if i not in set(live)]
        if live:
            out += [(live[j], res) for j, res in super().read_many([reads[i] for i in live])]
        return out


FlakyFsBackend.reset()


class FlakyFsTier(KVStoreTier):
    backend_cls = FlakyFsBackend


class FlakyRemoteBackend(FlakyFsBackend):
    """The same, taken for a remote backend: its tier gets the default remote detector."""

    remote = True


class FlakyRemoteTier(KVStoreTier):
    backend_cls = FlakyRemoteBackend


def flaky_tier(root: object, **kw: object) -> dict[str, object]:
    """The tier dict of a flaky fs tier under ``root``."""
    return {"type": "FlakyFsTier", "module_path": "tests.tier.flaky", "root_dir": str(root),
            "store_linger_s": 0, **kw}
