"""vLLM's backpressure detector for remote tiers, fed store failures as the breaker counts them.

vLLM 0.33 calls the detector's ``on_store_failed`` for every store job reported
with ``success=False``, and a store job in which any block failed is one (the
tiering contract: ``success`` only when every key was stored). With a
``failure_threshold`` the detector then sheds cascades once that many jobs in
a row failed. In a partial outage -- one dead Redis Cluster master of three,
a failed disk under some shards -- nearly every job fails in part while the
live part stores its blocks, and the detector would shed those stores too
(in the dead-master test, 25 of 201 blocks for live masters were never
offered). :class:`BreakerCountedDetector` hears a failure only where the
circuit breaker (:mod:`kvstore_tiers.health`) does: a job in which the backend
answered no block and some failed transiently, or one refused without I/O
(circuit open, queue full). A job in which the backend answered some block
ends a run of failures, as a stored job does; one cancelled by ``drain_jobs``
counts neither way.

The tier's ledger appends one verdict to :attr:`failed_stores` for every
failed store job it reports, in the order it reports them; vLLM's manager
handles a tier's results in that order and calls ``on_store_failed`` once for
each failed store, which takes the next verdict.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from vllm.v1.kv_offload.tiering.backpressure import EMABackpressureDetector


class BreakerCountedDetector(EMABackpressureDetector):
    """vLLM's EMA detector whose ``on_store_failed`` counts only whole failures (module doc).

    Scheduler thread only, as vLLM's detector is.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        #: One per failed store job reported and not yet handled by vLLM: True
        #: a failure of the tier, False the backend answered some of its blocks,
        #: None cancelled.
        self.failed_stores: deque[bool | None] = deque()

    def on_store_failed(self) -> None:
        verdict = self.failed_stores.popleft() if self.failed_stores else True
        if verdict:
            super().on_store_failed()
        elif verdict is False:
            self._consecutive_failures = 0  # the backend serves: the run ends
