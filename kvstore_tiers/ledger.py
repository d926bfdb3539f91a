"""The tier's ledger: what finished (or refused) transfers mean on the scheduler side.

:class:`Ledger` applies a finished job's :class:`~kvstore_tiers.outcome.Summary`
(one entry point per outcome: :meth:`Ledger.stored`, :meth:`Ledger.loaded`;
the ledger knows no job class), a deadline expiry or a refusal at submit to
the scheduler thread's state -- the presence index, the failed-load
verdicts, the circuit breaker, the counters and the kv events -- and
returns vLLM's ``JobResult``.

Scheduler thread only (vLLM calls ``get_finished_jobs`` and ``submit_*``
there), so no lock. A fully successful job costs a few counter updates and
no per-key work: its keys share one presence receipt
(:mod:`kvstore_tiers.presence`).

Failed promotions, as vLLM's own tiers treat them (``AsyncLookupManager.mark_miss``,
vllm#49328): a key whose load failed gets a MISS verdict shared by every
request. Each request that looks the key up while the verdict lives is
answered MISS and joins it; the verdict ends when every request that holds
it has finished (the next lookup then probes the backend afresh), or at
once when a store of the key completes (the block was recomputed and stored
again). The request whose load failed holds the verdict until it finishes,
so a doomed promotion is never retried in a loop (vLLM #49176). Unlike
``mark_miss``, which only reaches keys with a cached probe, the verdict also
covers keys this process stored itself (answered from the presence index).
A load cancelled before it started (``drain_jobs``) is no failed load: it
never reached the backend, so its keys get no verdict.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from collections.abc import Collection
from typing import Any

from vllm.v1.kv_offload.base import Locality, Medium, OffloadingEvent
from vllm.v1.kv_offload.tiering.base import JobResult

from kvstore_tiers.backpressure import BreakerCountedDetector
from kvstore_tiers.config import TierConfig
from kvstore_tiers.health import BreakerState, CircuitBreaker
from kvstore_tiers.metrics import TierMetrics
from kvstore_tiers.outcome import Summary
from kvstore_tiers.presence import PresenceIndex, settle
from kvstore_tiers.ratelimit import RateLimitedLogger

logger = logging.getLogger("kvstore_tiers.tier")

#: Evicted keys the presence index forgets per get_finished_jobs.
FORGET_PER_POLL = 256


class Ledger:
    """Scheduler-side state of one tier and the rules that update it."""

    def __init__(self, label: str, config: TierConfig, row_bytes: int,
                 events: list[OffloadingEvent] | None, detector: Any = None,
                 log: logging.Logger = logger) -> None:
        self.label = label
        self.row_bytes = row_bytes
        self.load_timeout_s = config.load_timeout_s
        self.metrics = TierMetrics(label=label)
        self.counters = self.metrics.counters
        self.breaker = CircuitBreaker(label, config.failure_threshold, config.breaker_cooldown_s,
                                      log=log)
        self.presence = PresenceIndex(config.presence_capacity)
        #: MISS verdicts of failed loads: key -> the requests that hold it.
        self.verdicts: dict[bytes, set[str]] = {}
        #: The same, by request (what ``forget_request`` releases).
        self._failed_by_req: dict[str, set[bytes]] = {}
        #: kv events not yet taken by vLLM (None: the tier emits none).
        self.events = events
        #: Keys evicted while their store job was in flight (kv events on): that
        #: job's stored event must leave them out (see :meth:`forget_evicted`).
        self._evicted_in_flight: set[bytes] = set()
        #: Load jobs reported failed at their deadline while an I/O thread still ran.
        self.load_timeouts = 0
        #: Warnings of the scheduler thread (``log``: the tier's SchedulerLogger).
        self.warn = RateLimitedLogger(log, interval_s=30.0)
        self._log = log
        #: Backpressure: bytes of store jobs submitted and not yet reported.
        self.store_bytes_in_flight = 0
        #: Where the tier's backpressure detector takes a verdict per failed store
        #: job reported (:mod:`kvstore_tiers.backpressure`); None: it takes none.
        self.failed_stores: deque[bool | None] | None = (
            detector.failed_stores if isinstance(detector, BreakerCountedDetector) else None)

    # -- refused at submit -------------------------------------------------------------
    def refused(self, job_id: int, req_id: str, keys: Collection[bytes], is_load: bool
                ) -> JobResult:
        """A job failed before it reached the pool (breaker open, queue full, bad ids)."""
        if is_load:
            self.fail_loads(req_id, keys)
        else:
            self.counters.stores_dropped += len(keys)
            self._failed_store(True)
        return JobResult(job_id=job_id, success=False)

    def _failed_store(self, verdict: bool | None) -> None:
        """A failed store job is reported: a failure of the tier (True), one the
        backend answered in part (False) or a cancelled one (None)."""
        if self.failed_stores is not None:
            self.failed_stores.append(verdict)

    def fail_loads(self, req_id: str, keys: Collection[bytes]) -> None:
        """Count ``keys`` as failed loads of request ``req_id`` and give them a MISS verdict."""
        self.counters.load_failures += len(keys)
        self._hold_verdicts(req_id, keys)

    # -- evicted by the backend or its server -------------------------------------------
    def forget_evicted(self, evicted: deque[bytes], medium: Medium, locality: Locality
                       ) -> None:
        """Keys left the tier (its capacity control, a server's eviction or
        expiry): the presence index forgets up to :data:`FORGET_PER_POLL` of
        ``evicted`` (oldest first, taken from it), so a step never pays for a
        whole evictor round (until a later poll takes the rest, a lookup of one
        of them answers HIT and its load fails, is counted and recomputed).
        With kv events on, one ``removed`` event names those it held (blocks
        this process stored or found), so that a consumer of the events stops
        counting them as stored. A key whose store job is still in flight gets
        no removal: its job's stored event, not yet sent, leaves it out (sent
        after a removal, it would leave the consumer believing it stored)."""
        presence, events = self.presence, self.events
        held: list[bytes] = []
        for k in [evicted.popleft() for _ in range(min(len(evicted), FORGET_PER_POLL))]:
            was_stored = presence.forget(k)
            if events is None or was_stored is None:
                continue
            if was_stored:
                held.append(k)
            else:
                self._evicted_in_flight.add(k)
        if held and events is not None:
            events.append(OffloadingEvent(keys=held, medium=medium, removed=True,
                                          locality=locality))

    # -- MISS verdicts of failed loads (module docstring) ---------------------------------
    def is_failed(self, key: bytes, req_id: str) -> bool:
        """True (and ``req_id`` holds the verdict from now on) if ``key``'s load failed."""
        holders = self.verdicts.get(key)
        if holders is None:
            return False
        if req_id not in holders:
            holders.add(req_id)
            self._failed_by_req.setdefault(req_id, set()).add(key)
        return True

    def forget_request(self, req_id: str) -> None:
        """Request ``req_id`` finished: release the verdicts it held."""
        for key in self._failed_by_req.pop(req_id, ()):
            holders = self.verdicts.get(key)
            if holders is not None:
                holders.discard(req_id)
                if not holders:
                    del self.verdicts[key]

    def _hold_verdicts(self, req_id: str, keys: Collection[bytes]) -> None:
        failed = self.verdicts
        for key in keys:
            holders = failed.get(key)
            if holders is None:
                holders = failed[key] = set()
            holders.add(req_id)
        self._failed_by_req.setdefault(req_id, set()).update(keys)

    def _end_verdicts(self, keys: Collection[bytes]) -> None:
        """``keys`` were stored again: their verdicts end for every request."""
        failed, by_req = self.verdicts, self._failed_by_req
        for key in keys:
            for req_id in failed.pop(key, ()):
                held = by_req.get(req_id)
                if held is not None:
                    held.discard(key)

    # -- finished: one entry point per outcome ----------------------------------------
    # A finished job settles itself (:meth:`Job.settle <kvstore_tiers.job.Job.settle>`)
    # through one of these, with its condensed summary: the ledger knows outcomes,
    # not job classes.
    def stored(self, s: Summary, receipt: Any, pinned_bytes: int) -> JobResult:
        """Apply a finished store's summary (its keys share ``receipt`` in the
        presence index; it pinned ``pinned_bytes`` of the primary, counted in
        :attr:`store_bytes_in_flight`); vLLM's JobResult for it. Never raises:
        if applying it breaks, the store is reported failed."""
        self.store_bytes_in_flight -= pinned_bytes
        try:
            answered = self._settled(s, "store_seconds")
            self._apply_store(s, receipt)
            # s.bad: what result.success says, without touching the JobResult
            # (cold by now). As the breaker counts it: cancelled ones neither way.
            if s.bad:
                self._failed_store(False if answered else (True if s.transient else None))
            return s.result  # type: ignore[return-value]
        except Exception:
            self._broke(s)
            return self.failed(s.job_id, False, "", [*s.ok, *s.bad], s.unwritten, receipt)

    def loaded(self, s: Summary, req_id: str) -> JobResult:
        """Apply a finished load's summary for request ``req_id``; vLLM's
        JobResult for it. Never raises (as :meth:`stored`)."""
        try:
            self._settled(s, "load_seconds")
            self._apply_load(s, req_id)
            return s.result  # type: ignore[return-value]
        except Exception:
            self._broke(s)
            return self.failed(s.job_id, True, req_id, [*s.ok, *s.bad], (), None)

    def _settled(self, s: Summary, latency: str) -> int:
        """What every finished job records: the breaker's keys and its latency;
        how many keys the backend answered."""
        assert s.result is not None
        # A job that offered the backend nothing records (0, 0): it proves nothing,
        # and a half-open circuit probes again with the next job.
        answered = len(s.ok) + s.missing + s.corrupt
        self.breaker.record_keys(answered, s.transient)
        if s.ok or s.bad:  # one that moved nothing is no transfer's latency
            self.metrics.observe(latency, time.monotonic() - s.submit_time)
        return answered

    def _broke(self, s: Summary) -> None:
        # A job taken from the pool must still be reported, or vLLM waits on it forever.
        self._log.exception("kvstore tier %s: completing job %d failed; reporting it failed",
                            self.label, s.job_id)

    def failed(self, job_id: int, is_load: bool, req_id: str, keys: list[bytes],
               unwritten: list[bytes] | tuple[()], receipt: Any) -> JobResult:
        """Report a job failed as a whole (its outcomes are unknown, or applying
        them broke): a load's ``keys`` of ``req_id`` as failed loads, a store's
        as failed stores that leave the presence index (``unwritten``: those not
        offered to the backend). What the backend answered is unknown, so the
        breaker learns nothing; a half-open probe is given back, or no job would
        probe again."""
        self.breaker.record_keys(0, 0)
        if is_load:
            self.fail_loads(req_id, keys)
        else:
            # Blocks not offered to the backend are no failed stores.
            self.counters.store_failures += len(keys)
            for part in (keys, unwritten):
                self.presence.discard_receipt(part, receipt)
                self._evicted_in_flight.difference_update(part)  # no stored event follows
            self._failed_store(True)
        return JobResult(job_id=job_id, success=False)

    def expired(self, job_id: int, req_id: str, ok: list[bytes], bad: list[bytes],
                submit_time: float, transfer_time: float) -> JobResult:
        """Report a load job of ``req_id`` at its deadline: ``ok`` landed, ``bad``
        failed (:meth:`Job.expire <kvstore_tiers.job.Job.expire>` took them)."""
        c = self.counters
        c.objects_loaded += len(ok)
        c.raw_bytes_read += len(ok) * self.row_bytes
        self.metrics.observe("load_seconds", time.monotonic() - submit_time)
        self.breaker.record_keys(len(ok), len(bad))
        if not bad:
            return JobResult(job_id=job_id, success=True, transfer_time=transfer_time)
        self.load_timeouts += 1
        for k in bad:
            self.presence.discard(k)
        self.fail_loads(req_id, bad)
        self.warn.warning(
            "load-timeout", "kvstore tier %s: load of %d blocks passed its %.3fs deadline; "
            "reported failed (vLLM recomputes)", self.label, len(bad), self.load_timeout_s or 0.0,
        )
        return JobResult(job_id=job_id, success=False, successful_keys=tuple(ok) or None,
                         transfer_time=transfer_time)

    def _apply_store(self, s: Summary, receipt: Any) -> None:
        # No per-key work for stored keys: their receipt makes all of them
        # stored; failed and unwritten ones are forgotten.
        settle(receipt)
        c = self.counters
        c.objects_skipped += s.existed
        c.objects_stored += s.written
        c.raw_bytes_written += s.written * self.row_bytes
        c.stored_bytes_written += s.frame_bytes
        if s.unwritten:
            self.presence.discard_receipt(s.unwritten, receipt)
        if self.verdicts:
            self._end_verdicts(s.ok)
        if s.bad:
            self.presence.discard_receipt(s.bad, receipt)
            c.transfers_cancelled += s.cancelled
            c.store_failures += len(s.bad) - s.cancelled
            if len(s.bad) > s.cancelled:
                self.warn.warning(
                    "store-failed", "kvstore tier %s: %d of %d stores failed: %s",
                    self.label, len(s.bad) - s.cancelled, len(s.ok) + len(s.bad),
                    s.first_error or s.first_corrupt,
                )
        if self._evicted_in_flight:
            self._leave_out_evicted(s)
        if s.event is not None and self.events is not None:
            self.events.append(s.event)

    def _leave_out_evicted(self, s: Summary) -> None:
        """Drop from a store's event the keys evicted while it was in flight."""
        gone = self._evicted_in_flight
        if s.event is not None:
            s.event.keys = [k for k in s.event.keys if k not in gone]
            if not s.event.keys:
                s.event = None
        gone.difference_update(s.ok)
        gone.difference_update(s.bad)
        gone.difference_update(s.unwritten)

    def _apply_load(self, s: Summary, req_id: str) -> None:
        # Loaded keys are in the presence index already: stored by this
        # process, or added when the existence check found them.
        c = self.counters
        c.objects_loaded += len(s.ok)
        c.raw_bytes_read += len(s.ok) * self.row_bytes
        c.stored_bytes_read += s.frame_bytes
        if not s.bad:
            return
        c.transfers_cancelled += s.cancelled
        # A cancelled slot (drain_jobs: reset_cache, sleep) never reached the
        # backend: its object is as good as before, so it keeps its place in
        # the index and gets no MISS verdict; the next lookup promotes it again.
        failed = _without(s.bad, s.cancelled_keys) if s.cancelled else s.bad
        if not failed:
            return
        for key in failed:
            self.presence.discard(key)
        c.load_misses += s.missing
        c.corrupt_objects += s.corrupt
        c.load_failures += s.transient
        if s.corrupt:
            self.warn.warning(
                "corrupt", "kvstore tier %s: rejected %d corrupt object(s) (%s); removed, "
                "they will be recomputed", self.label, s.corrupt, s.first_corrupt,
            )
        if s.transient:
            self.warn.warning(
                "load-failed", "kvstore tier %s: %d load(s) failed: %s",
                self.label, s.transient, s.first_error,
            )
        self._hold_verdicts(req_id, failed)

    # -- inspection ----------------------------------------------------------------------
    def gauges(self, queued_chunks: int, evicted_objects: int) -> dict[str, float]:
        """The tier's gauges for vLLM's stats (and the eviction count, kept by the backend)."""
        self.counters.objects_evicted = evicted_objects
        state = self.breaker.state
        return {
            "healthy": float(state is BreakerState.CLOSED),
            "circuit_state": float(int(state)),
            "queued_chunks": float(queued_chunks),
            "store_bytes_in_flight": float(self.store_bytes_in_flight),
        }

    def log_totals(self) -> None:
        """One line of the tier's lifetime counters (at shutdown)."""
        c = self.counters
        logger.info(
            "kvstore tier '%s' shut down: %d objects stored (%d skipped), %d loaded, "
            "%d corrupt, %d store / %d load failures, %d dropped",
            self.label, c.objects_stored, c.objects_skipped, c.objects_loaded,
            c.corrupt_objects, c.store_failures, c.load_failures, c.stores_dropped,
        )

    def write_stats_file(self, directory: str | None, backend: str, namespace: str,
                         suffix: str) -> None:
        """Write the counters as JSON into ``directory`` (None: do nothing); at shutdown."""
        if not directory:
            return
        try:
            os.makedirs(directory, exist_ok=True)
            path = os.path.join(directory, f"{self.label}-{suffix}.json")
            with open(path, "w") as f:
                json.dump({"tier_type": self.label, "backend": backend, "namespace": namespace,
                           "counters": self.counters.as_dict()}, f, indent=2)
        except OSError as exc:
            logger.warning("kvstore tier %s: could not write stats file: %s", self.label, exc)


def _without(keys: list[bytes], dropped: Collection[bytes]) -> list[bytes]:
    """``keys`` less those in ``dropped``, in order."""
    gone = set(dropped)
    return [k for k in keys if k not in gone]
