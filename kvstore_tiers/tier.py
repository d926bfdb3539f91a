"""KVStoreTier: vLLM's ``SecondaryTierManager`` for any kvstore backend, scheduler side.

One generic adapter, one backend per subclass (``backend_cls``): it answers
lookups (presence index, then vLLM's asynchronous existence check), hands
transfers to the I/O pool as :class:`~kvstore_tiers.job.Job`\\ s and applies
their condensed outcomes through its :class:`~kvstore_tiers.ledger.Ledger`.

Threading contract (vLLM contract sections 4.0-4.16):

* Every public method below is called on the scheduler side with vLLM's
  tiering lock held. None of them does I/O, blocks (except ``drain_jobs``
  and ``shutdown``) or raises: each body is wrapped so an unexpected error
  becomes a failed job or a MISS, logged through a
  :class:`~kvstore_tiers.log.SchedulerLogger` (a thread of its own writes it).
* Scheduler-owned state (``_deadlined``, ``_ready``, the ledger's presence
  index, verdicts, counters, breaker) is touched only on that thread; I/O
  threads touch only their jobs and those jobs' rows, and hand finished jobs
  back through the pool's ``finished`` deque.
* What a config adds around the transfers (store admission, read-through)
  is a :class:`~kvstore_tiers.layer.TierLayer` in :attr:`KVStoreTier.layers`,
  built by :func:`kvstore_tiers.assembly.layers` and reached only through
  that interface; the tier names none of them.
* ``lookup``, ``submit_*`` and ``get_finished_jobs`` run for every block and
  step, so they allocate as little as they can (each container brings the
  next cyclic-GC pass closer: :class:`~kvstore_tiers.pool.PoolJob`).

A key whose load failed answers MISS until its verdict ends (:mod:`kvstore_tiers.ledger`:
vllm#49328, #49176): a doomed promotion is never retried in a loop.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import deque
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvstore_tiers import assembly, compat, loadtrace
from kvstore_tiers.backends.base import Backend
from kvstore_tiers.codecs import resolve_compression
from kvstore_tiers.config import TierConfig
from kvstore_tiers.existence import ExistenceCheck
from kvstore_tiers.health import BreakerState
from kvstore_tiers.job import (
    Job,
    LoadObserver,
    PrimaryRows,
    TouchJob,
    TransferContext,
    observe_both,
)
from kvstore_tiers.layer import TierLayer
from kvstore_tiers.ledger import Ledger
from kvstore_tiers.log import SchedulerLogger, attach_to_vllm_logging
from kvstore_tiers.metrics import metric_definitions
from kvstore_tiers.outcome import nothing_stored
from kvstore_tiers.ratelimit import RateLimitedLogger
from kvstore_tiers.shm import sweep_once

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec

logger = logging.getLogger(__name__)

#: Directory where every tier writes a JSON snapshot of its counters at shutdown.
STATS_DIR_ENV = "KVSTORE_TIERS_STATS_DIR"

_CLOSED = BreakerState.CLOSED


class KVStoreTier(SecondaryTierManager):
    """Secondary tier backed by a kvstore :class:`Backend`.

    Subclasses set ``backend_cls``. Constructor keys are the backend's
    ``config_model`` fields (every key of the tier dict except ``type``,
    ``module_path`` and ``backpressure``); a bad key fails startup with a
    :class:`~kvstore_tiers.errors.ConfigError` naming it.
    """

    backend_cls: ClassVar[type[Backend]]
    medium: ClassVar[Medium] = Medium.STORAGE
    _closed = False  # set by shutdown

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any | None = None,
        **tier_kwargs: Any,
    ) -> None:
        attach_to_vllm_logging()
        sweep_once()  # regions of killed engines would leak /dev/shm
        remote = self.backend_cls.remote
        config = assembly.tier_config(self.backend_cls.config_model, offloading_spec, tier_type,
                                      tier_kwargs)
        self.load_trace = loadtrace.start(tier_type)  # $KVSTORE_TIERS_LOAD_TRACE; None: off
        if backpressure_detector is None:
            backpressure_detector = assembly.default_detector(remote, tier_type, config)
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.config: TierConfig = config
        self.locality = Locality(config.locality or ("REMOTE" if remote else "LOCAL"))
        cipher = assembly.open_cipher(config)
        self.encrypted = cipher is not None
        self.namespace = assembly.make_namespace(offloading_spec, config, cipher, tier_type)
        self.codec_id = resolve_compression(config.compression, remote=remote,
                                            dtype_bytes=self.namespace.dtype_bytes)
        self.backend: Backend = self.backend_cls(config, self.namespace)
        self.backend.open()
        tuning = self.backend.tuning
        self._store_batch, self._load_batch = assembly.plan_batches(
            tuning, self._block_size_bytes)
        self.rows = PrimaryRows(primary_kv_view, self._block_size_bytes)
        self._log = SchedulerLogger(logger, tier_type)  # the scheduler thread's log lines
        ledger = self._ledger = Ledger(tier_type, config, self._block_size_bytes,
                                       assembly.event_list(offloading_spec, config, tier_type),
                                       self.bp_detector, self._log)
        # Read directly by the hot paths; public to read, changed only here and by the ledger.
        self.metrics, self.breaker, self.presence = ledger.metrics, ledger.breaker, ledger.presence
        self._failed, self._warn = ledger.verdicts, ledger.warn
        evictions = self.backend.evictions
        self._evicted_keys = evictions.keys if evictions is not None else ()
        #: Loads with a deadline, until reported (settled jobs leave at the next poll).
        self._deadlined: dict[int, Job] = {}
        self._ready: deque[JobResult] = deque()  # refused at submit, reported next poll
        self._max_store_bytes_in_flight = assembly.store_backlog_bound(
            config.max_store_bytes_in_flight, self.rows.count * self._block_size_bytes)
        self.pool = assembly.start_pool(config, tier_type, self.namespace, self.codec_id,
                                         tuning.header_align, cipher)
        #: What the config adds around the transfers, composed in this order
        #: (:mod:`kvstore_tiers.layer`); the tier reaches them only through it.
        self.layers: tuple[TierLayer, ...] = tuple(assembly.layers(
            config, tier_type, self.backend, ledger.counters, self.presence, self.pool,
            self._store_batch, self._block_size_bytes))
        self._unwired = bool(self.layers)  # wired at the first step (on_schedule_end)
        ctx = TransferContext(
            self.backend, self.rows, self.namespace.object_name, tier_type, self.medium,
            self.locality, ledger.events is not None, RateLimitedLogger(logger, interval_s=30.0),
            trace=self.load_trace)
        for layer in self.layers:
            ctx = layer.compose(ctx)
        self._ctx = ctx
        self._lookup = ExistenceCheck(self._ctx)
        logger.info("kvstore tier '%s' ready: %s, namespace %s, codec %s, chunk %d bytes x %d "
                    "rows, %d+%d I/O threads, locality %s", tier_type, self.backend.describe(),
                    self.namespace.describe(), self.codec_id.name.lower(), self._block_size_bytes,
                    self.rows.count, config.n_read_threads, config.n_write_threads,
                    self.locality.value)

    # ------------------------------------------------------------------ vLLM API
    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        return metric_definitions()

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        try:
            # The common case in few attribute lookups and calls (vLLM calls this for
            # every block of every waiting request, every step): no failed loads
            # anywhere, circuit closed, the key stored by this process: HIT.
            if self._failed and self._ledger.is_failed(key, req_context.req_id):
                return LookupResult.MISS
            breaker = self.breaker
            if breaker.state is not _CLOSED and breaker.is_open:
                return LookupResult.MISS
            if self.presence.stored(key):
                return LookupResult.HIT
            found = self._lookup.lookup(key, req_context)
            if found is None:
                return LookupResult.RETRY
            if not found:
                return LookupResult.MISS
            self.presence.add(key)  # known to exist: later lookups and stores skip the check
            return LookupResult.HIT
        except Exception:
            self._log.exception("kvstore tier %s: lookup failed; answering MISS", self.tier_type)
            return LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        try:
            self._submit(job_metadata, is_load=False)
        except Exception:
            self._log.exception("kvstore tier %s: submit_store failed", self.tier_type)
            self._fail_now(job_metadata.job_id, job_metadata, is_load=False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        try:
            self._submit(job_metadata, is_load=True)
        except Exception:
            self._log.exception("kvstore tier %s: submit_load failed", self.tier_type)
            self._fail_now(job_metadata.job_id, job_metadata, is_load=True)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results: list[JobResult] = []
        try:
            if self._evicted_keys:
                self._ledger.forget_evicted(self._evicted_keys, self.medium, self.locality)
            for layer in self.layers:  # work of their own, ready to queue
                layer.step()
            while self._ready:
                results.append(self._ready.popleft())
            finished, retired, ledger = self.pool.finished, self.pool.retired, self._ledger
            while finished:
                job = finished.popleft()
                retired.append(job)  # freed by an I/O thread's next batch, not this thread
                # Every job settles itself (one completion protocol; never raises).
                result = job.settle(ledger)
                if result is not None:
                    results.append(result)
            job = None  # this frame's reference too: the pool's is the last
            deadlined = self._deadlined
            if deadlined:
                now = time.monotonic()
                for job in [j for j in deadlined.values() if j.reported or now > j.deadline]:
                    del deadlined[job.job_id]
                    if not job.reported:  # past its deadline, still running
                        results.append(job.settle_expired(ledger))
                job = None
            if self.load_trace is not None:
                self.load_trace.picked(results)
        except Exception:
            self._log.exception("kvstore tier %s: get_finished_jobs failed", self.tier_type)
        return results

    def take_events(self) -> Iterable[OffloadingEvent]:
        events = self._ledger.events
        if events:  # None: kv events off
            self._ledger.events = []
        return events or ()

    def has_pending_work(self) -> bool:
        """Work no vLLM job waits on: a layer's own, or finished jobs to settle."""
        for layer in self.layers:
            if layer.pending_bytes:
                return True
        return bool(self.pool.finished)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Refresh recency/expiry (``supports_touch``: redis ``ttl_s``, fs LRU) of blocks
        the primary just reused: a batch for the I/O pool, dropped if it is full."""
        try:
            if not type(self.backend).supports_touch or not keys:
                return
            names = [self.namespace.object_name(k) for k in keys if k in self.presence]
            if names:
                self.pool.submit(TouchJob(self.backend, names), is_load=False)
        except Exception:
            self._log.exception("kvstore tier %s: touch failed", self.tier_type)

    def on_request_finished(self, req_context: ReqContext) -> None:
        try:
            self._lookup.cleanup(req_context.req_id)
            self._ledger.forget_request(req_context.req_id)
        except Exception:
            self._log.exception("kvstore tier %s: on_request_finished failed", self.tier_type)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        try:
            self._lookup.flush()
            if self._unwired:  # once: vLLM's manager and all its tiers exist by now
                self._unwired = False
                tiers = compat.secondary_tiers(self._offloading_spec)
                for layer in self.layers:
                    layer.wire(self, tiers)
        except Exception:
            self._log.exception("kvstore tier %s: on_schedule_end failed", self.tier_type)

    def drain_jobs(self) -> None:
        """Cancel queued transfers (they report failure) and wait for running ones."""
        try:
            self.pool.cancel_queued()
            self.pool.wait_idle()
            # vLLM frees the rows loaded: the layers and the observers of this
            # tier's loads drop what they noted of them.
            for layer in self.layers:
                layer.drain()
            if self._ctx.observer is not None:
                self._ctx.observer.drain()
        except Exception:
            self._log.exception("kvstore tier %s: drain_jobs failed", self.tier_type)

    def get_stats(self) -> Any:
        try:
            return self.metrics.collect(self.gauges())
        except Exception:
            self._log.exception("kvstore tier %s: get_stats failed", self.tier_type)
            return None

    def shutdown(self) -> None:
        """Stop lookups and I/O threads, close the backend, drop views of the primary."""
        if self._closed:
            return
        self._closed = True
        # The layers first: they may read the backend, or take other tiers' loads.
        steps = [*(layer.close for layer in self.layers), self._lookup.shutdown,
                 self.pool.shutdown, self.backend.close]
        if self.load_trace is not None:
            steps.append(self.load_trace.close)  # writes the trace
        for step in steps:
            try:
                step()
            except Exception:
                self._log.exception("kvstore tier %s: error during shutdown", self.tier_type)
        self.rows.release()
        self._ledger.write_stats_file(os.environ.get(STATS_DIR_ENV), self.backend.describe(),
                                      self.namespace.name, f"{os.getpid()}-{id(self):x}")
        self._ledger.log_totals()
        self._log.close()  # writes what the scheduler thread logged

    def observe_loads(self, observer: LoadObserver) -> None:
        """From now on, the blocks this tier's loads verify are reported to
        ``observer`` as well (wired by a layer of another tier:
        :meth:`TierLayer.wire <kvstore_tiers.layer.TierLayer.wire>`). Scheduler
        thread; jobs already queued keep the context they were built with."""
        self._ctx = dataclasses.replace(self._ctx,
                                        observer=observe_both(self._ctx.observer, observer))

    # ------------------------------------------------------------- inspection
    counters = property(lambda self: self.metrics.counters, doc="Cumulative counters.")

    load_timeouts = property(lambda self: self._ledger.load_timeouts, doc="Load jobs reported "
                             "failed at their deadline while an I/O thread still ran.")

    def __repr__(self) -> str:  # never a secret: describe() redacts
        return f"{type(self).__name__}(type={self.tier_type!r}, {self.backend.describe()})"

    def gauges(self) -> dict[str, float]:
        """The gauges as exported now (queued chunks, store bytes in flight, health...)."""
        evictions = self.backend.evictions
        return self._ledger.gauges(self.pool.queued_chunks,
                                   evictions.objects if evictions is not None else 0)

    # ---------------------------------------------------------------- internals
    def _answered_without_backend(self, job_id: int) -> None:
        """A store job let through the breaker ends without reaching the backend
        (nothing to write, or dropped for backpressure): reported as storing
        nothing, and counted neither way by the breaker, so a half-open circuit
        gets its probe back and the next job probes (else it would wait for
        this job's outcome for ever, every lookup a miss)."""
        self.breaker.record_keys(0, 0)
        self._ready.append(nothing_stored(job_id))

    def _fail_now(self, job_id: int, job: TransferJob, is_load: bool) -> None:
        """Report a job failed at the next get_finished_jobs (never raises)."""
        try:
            result = self._ledger.refused(job_id, job.req_context.req_id, job.keys, is_load)
        except Exception:
            result = JobResult(job_id=job_id, success=False)
        self._ready.append(result)

    def _submit(self, tj: TransferJob, is_load: bool) -> None:
        # Bulk operations only: the I/O threads split the job, name the objects and
        # condense the outcomes. vLLM's own key list, not a copy (see Job).
        keys = tj.keys if type(tj.keys) is list else list(tj.keys)
        cids = tj.chunk_ids
        cids = cids.tolist() if isinstance(cids, np.ndarray) else [int(c) for c in cids]
        n_rows = self.rows.count
        if len(cids) != len(keys) or (cids and (min(cids) < 0 or max(cids) >= n_rows)):
            self._warn.warning("bad-chunk", "kvstore tier %s: job %d has chunk ids outside "
                               "[0, %d); failing it", self.tier_type, tj.job_id, n_rows)
            self._fail_now(tj.job_id, tj, is_load)
            return
        if self._closed or not self.breaker.allow():
            self._fail_now(tj.job_id, tj, is_load)
            return
        if not is_load and self.presence.holds_any(keys):
            keys, cids = self.presence.absent(keys, cids)
            self.metrics.counters.objects_skipped += len(tj.keys) - len(keys)
        # What a layer composed into the context (a store filter, a load
        # observer) is asked by the job on the I/O thread that runs it.
        if not keys:
            self._answered_without_backend(tj.job_id)
            return
        if not is_load:
            nbytes = len(keys) * self._block_size_bytes
            in_flight = self._ledger.store_bytes_in_flight
            if in_flight and in_flight + nbytes > self._max_store_bytes_in_flight:
                # Backpressure: the tier is behind. Queueing would pin more of
                # the primary, whose rows promotions need; drop it (vLLM keeps
                # the blocks in the primary; a later lookup here misses).
                self.metrics.counters.stores_dropped_backpressure += len(keys)
                self._answered_without_backend(tj.job_id)
                return
        timeout = self.config.load_timeout_s
        # The job is queued once; I/O threads take it a batch at a time, so a
        # request's chunks move in parallel at no cost to this thread.
        batch = self._load_batch if is_load else self._store_batch
        job = Job(
            self._ctx, tj.job_id, is_load=is_load, req_id=tj.req_context.req_id, keys=keys,
            cids=cids, submit_time=tj.submit_time,
            deadline=time.monotonic() + timeout if is_load and timeout else None,
            batch=batch,
        )
        if not is_load:
            # In the index at once (later stores of these keys skip), stored
            # for lookups once the job's completion settles its receipt; those
            # its store filter did not keep leave it then.
            self.presence.update(keys, job.receipt)
        if job.deadline is not None:
            self._deadlined[tj.job_id] = job
        if not self.pool.submit(job, is_load):
            self._deadlined.pop(tj.job_id, None)
            if not is_load:
                self.presence.discard_receipt(keys, job.receipt)
            self._warn.warning("queue-full", "kvstore tier %s: I/O queue full (%d chunks); "
                               "failing job", self.tier_type, self.pool.queued_chunks)
            self._fail_now(tj.job_id, tj, is_load)
        elif not is_load:
            self._ledger.store_bytes_in_flight += nbytes
