"""TierLayer: the one interface through which a tier composes what runs around its transfers.

A tier's core moves blocks: it queues store and load jobs on its I/O pool
and settles what they report (:mod:`kvstore_tiers.tier`). What a
configuration adds around that -- store admission
(:class:`~kvstore_tiers.admission.AdmissionLayer`), read-through
(:class:`~kvstore_tiers.readthrough.ReadThrough`) -- is a layer: built by
:func:`kvstore_tiers.assembly.layers` from the validated config, held by the
tier in one list, and reached by the tier only through the hooks below, in
list order. A layer that is not configured is not in the list, and costs the
tier nothing.

The hooks a layer has into the transfers themselves are the two of
:mod:`kvstore_tiers.job`, which it adds to the tier's transfer context in
:meth:`TierLayer.compose`: a :class:`~kvstore_tiers.job.StoreFilter` (which
blocks of a store job to write) and a :class:`~kvstore_tiers.job.LoadObserver`
(told what each load verified).

Every hook runs on the tier's scheduler thread (``compose`` at start-up,
``close`` at shutdown), so each obeys the tier's contract: no I/O, no wait,
no long lock. A hook that raises is caught and logged by the tier.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstore_tiers.job import TransferContext


class TierLayer:
    """Something a tier composes around its transfers; every hook does nothing
    unless a layer overrides it."""

    __slots__ = ()

    def compose(self, ctx: TransferContext) -> TransferContext:
        """Start-up: the tier's transfer context with this layer's hooks added
        (its store filter, its load observer). A layer that queues jobs of its
        own keeps the context it returns for them."""
        return ctx

    def wire(self, tier: Any, tiers: Sequence[Any] | None) -> None:
        """The tier's first step: ``tiers`` are the secondary tiers vLLM's manager
        built, in ``secondary_tiers`` order, ``tier`` among them (None: vLLM's
        spec built none, a test's stand-in). vLLM builds the tiers one by one
        and calls none of them before its manager exists, so a layer that
        composes with other tiers is wired here, once."""

    def step(self) -> None:
        """Every poll of the tier (``get_finished_jobs``), before it takes its
        finished jobs: queue the work of the layer's own that is ready."""

    @property
    def pending_bytes(self) -> int:
        """Bytes of the layer's own work queued or running (no vLLM job waits on
        it, so the tier reports it as pending work to keep an idle engine
        stepping until it is done)."""
        return 0

    def drain(self) -> None:
        """The tier drained (its running jobs finished): vLLM may free the
        primary rows of what was loaded before now."""

    def close(self) -> None:
        """The tier shuts down, before its I/O threads and its backend stop."""
