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

from kvstore_tiers.backends.base import LoadItem, StoreItem
from kvstore_tiers.backends.eviction_log import EvictionLog
from kvstore_tiers.backends.fs import FileSystemBackend
from kvstore_tiers.errors import TransientError
from kvstore_tiers.frame import FrameCodec
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

    def _split(self, items: Sequence[Any], run: Any, codec: FrameCodec) -> list[Any]:
        live = [it for it in items if it.key not in self.dead]
        done = iter(run(live, codec) if live else ())
        return [TransientError("node down") if it.key in self.dead else next(done)
                for it in items]

    def store_many(self, items: Sequence[StoreItem], codec: FrameCodec
                   ) -> list[int | BaseException]:
        if not self.store_gate.is_set():
            self.store_stalled.set()
            self.store_gate.wait(30)
        return self._split(items, super().store_many, codec)

    def load_many(self, items: Sequence[LoadItem], codec: FrameCodec
                  ) -> list[int | BaseException]:
        return self._split(items, super().load_many, codec)


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
