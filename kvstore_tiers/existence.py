"""Existence checks: vLLM's asynchronous lookups answered by the backend.

A key the presence index does not hold is checked off the scheduler thread:
vLLM's ``AsyncLookupManager`` posts a step's keys to its worker thread, which
calls :meth:`ExistenceCheck.batch_lookup` (``Backend.exists_many``); the
verdict is there on a later step (:meth:`KVStoreTier.lookup
<kvstore_tiers.tier.KVStoreTier.lookup>`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager

if TYPE_CHECKING:
    from kvstore_tiers.job import TransferContext


class ExistenceCheck(AsyncLookupManager):
    """vLLM's AsyncLookupManager over ``Backend.exists_many`` (its worker thread)."""

    def __init__(self, ctx: TransferContext) -> None:
        super().__init__(tier_type=ctx.label)
        self._ctx = ctx

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> list[bool]:
        names = [self._ctx.object_name(k) for k in keys]
        # A list, never a generator: vLLM 0.32 iterates it outside its try.
        return [bool(x) for x in self._ctx.backend.exists_many(names)]
