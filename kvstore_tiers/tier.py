"""KVStoreTier: vLLM's ``SecondaryTierManager`` for any kvstore backend.

One generic adapter, one backend per subclass (``backend_cls``). It owns the
I/O pool, the frame codec, the presence index, the asynchronous existence
checks, the circuit breaker, metrics and events; the backend only moves
bytes.

Threading contract (vLLM contract sections 4.0-4.16):

* Every public method below is called on the scheduler side with vLLM's
  tiering lock held. None of them does I/O, blocks (except ``drain_jobs``
  and ``shutdown``) or raises: each body is wrapped so an unexpected error
  becomes a failed job or a MISS and is logged.
* Scheduler-owned state (``_deadlined``, ``_presence``, ``_failed_by_req``,
  counters, breaker) is touched only on that thread.
  I/O threads write only per-job outcome slots of jobs they were handed and
  the rows of the primary view those jobs own; completion is handed back
  through the pool's ``finished`` deque.

Failed promotions and vLLM #49176: a key whose load failed is remembered per
request (``_failed_by_req``) and answered MISS for that request until it
finishes, whatever the presence index or the existence check say, so a
doomed promotion is never retried in a loop. Corrupt objects are deleted;
later requests re-probe.

Load deadlines (``load_timeout_s``): a load job that has not finished by its
deadline is reported failed from the next ``get_finished_jobs()`` -- on the
scheduler thread, without waiting for the I/O thread, which may still be
stuck inside the backend (a stalled socket, a hung NFS read). Rows are
protected by a bounce-buffer protocol:

* with a deadline configured, backends never write a primary row: each load
  task decodes into a per-thread, page-aligned bounce buffer;
* a verified row is then copied into its primary row while holding the
  job's ``lock``, and only if the job is not ``expired``; the slot is marked
  ``landed`` inside the same critical section;
* expiring a job takes the same lock, sets ``expired`` and reports exactly
  the ``landed`` slots as ``successful_keys`` (vLLM keeps those rows and
  frees the rest at once).

So after the lock is released by the scheduler no I/O thread ever writes a
row of that job again: a late thread finds ``expired`` and discards its
bounce buffer, and its eventual pool completion is ignored (``reported``).
The scheduler holds the lock for at most one row copy. Without
``load_timeout_s`` loads decode straight into the rows (one copy less) and a
stuck backend is bounded only by its own socket timeouts. Stores are never
expired early: their I/O thread reads the pinned row, so reporting them
before it is done could let vLLM reuse the row mid-read; they rely on the
backend's timeouts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import threading
import time
from collections import deque
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
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
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvstore_tiers.backends.base import Backend, LoadItem, StoreItem, classify
from kvstore_tiers.codecs import resolve_compression
from kvstore_tiers.config import TierConfig, validate_config
from kvstore_tiers.errors import ObjectCorrupt, ObjectMissing, TransientError, detached
from kvstore_tiers.frame import FrameCodec
from kvstore_tiers.health import BreakerState, CircuitBreaker
from kvstore_tiers.metrics import TierMetrics, metric_definitions
from kvstore_tiers.namespace import Namespace
from kvstore_tiers.pool import IOPool, PoolJob
from kvstore_tiers.presence import PresenceIndex
from kvstore_tiers.ratelimit import RateLimitedLogger

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec

logger = logging.getLogger(__name__)

#: Directory where every tier writes a JSON snapshot of its counters at shutdown.
STATS_DIR_ENV = "KVSTORE_TIERS_STATS_DIR"


class _Job(PoolJob):
    """A vLLM job in flight: the keys the pool moves and their outcomes.

    Slot ``s`` is block ``keys[s]`` in primary row ``cids[s]`` (for stores,
    only the keys that were not already stored or in flight). The I/O thread
    that runs a slot writes ``outcomes[s]`` (``None`` loaded, ``True``/
    ``False`` stored/existed, or the backend error) and ``stored_bytes[s]``;
    the thread that finishes the job condenses them into ``summary``, so the
    scheduler thread applies a finished job with a few bulk operations.

    Built on vLLM's scheduler thread, so it allocates as little as it can
    there (see :class:`~kvstore_tiers.pool.PoolJob`): ``keys`` is vLLM's own
    key list (vLLM reads it again when the job completes, so nobody mutates
    it meanwhile), the per-slot lists are made by :meth:`start` on an I/O
    thread, and a store job is its own presence-index receipt (``done``).
    Only a load with a deadline gets its ``lock`` and ``landed`` at once:
    the scheduler may expire it before any I/O thread took it.
    """

    __slots__ = ("cids", "deadline", "done", "expired", "is_load", "keys", "landed", "lock",
                 "outcomes", "reported", "req_id", "stored_bytes", "submit_time", "summary",
                 "tier")

    def __init__(
        self, tier: KVStoreTier, job_id: int, *, is_load: bool, req_id: str,
        keys: Sequence[bytes], cids: Sequence[int], submit_time: float, deadline: float | None,
        batch: int,
    ) -> None:
        PoolJob.__init__(self, job_id, len(keys), batch)  # not super(): one object less
        self.tier = tier
        self.is_load = is_load
        self.req_id = req_id
        self.keys = keys
        self.cids = cids
        self.outcomes: list[Any] | tuple[()] = ()  # made by start()
        self.stored_bytes: list[int] | tuple[()] = ()  # frame bytes moved, per slot
        self.submit_time = submit_time
        self.deadline = deadline
        # Deadline protocol (module docstring): ``landed[slot]`` and ``expired``
        # change only under ``lock``; ``reported`` is scheduler-thread only.
        self.lock = threading.Lock() if deadline is not None else None
        self.landed: list[bool] | tuple[()] = [False] * len(keys) if deadline is not None else ()
        self.expired = False
        self.reported = False
        self.summary: _Summary | None = None
        #: Stores: this job is the presence index's receipt for its keys.
        self.done = False

    def start(self) -> None:
        n = self.n_slots
        self.outcomes = [None] * n
        self.stored_bytes = [0] * n

    def run(self, ctx: FrameCodec, start: int, stop: int) -> None:
        self.tier._run_slots(self, ctx, start, stop)

    def cancel(self, start: int, stop: int) -> None:
        err = TransientError("cancelled before it started (drain or shutdown)")
        outcomes = self.outcomes
        for s in range(start, stop):
            outcomes[s] = err

    def finish(self) -> None:
        self.summary = self.tier._summarise(self)
        # Drop the per-slot lists here, on the I/O thread: the scheduler only
        # reads the summary, and deallocating their ~50 objects there, cold
        # in its cache, made up much of a job's completion cost. (``landed``
        # stays: an expiring load reads it under ``lock``.)
        self.outcomes, self.stored_bytes, self.cids = (), (), ()

    def release(self) -> None:
        """Scheduler thread, once reported: drop what a receipt need not keep.

        A store job stays referenced by the presence index as its keys'
        receipt; only ``done`` matters then.
        """
        self.keys, self.summary = (), None


@dataclass(slots=True)
class _Summary:
    """A finished job's outcomes, condensed off the scheduler thread."""

    ok: list[bytes]  # stored (written or already there) / loaded
    bad: list[bytes]  # failed
    written: int = 0  # stores that wrote an object
    existed: int = 0  # stores that found the object already there
    frame_bytes: int = 0  # frame bytes written (new objects) or read (loaded)
    missing: int = 0  # loads: object gone
    corrupt: int = 0  # loads: object rejected (and removed)
    transient: int = 0  # I/O or service errors (they feed the circuit breaker)
    first_error: BaseException | None = None
    first_corrupt: BaseException | None = None
    #: vLLM's records, built on the finishing I/O thread (see KVStoreTier._summarise).
    result: JobResult | None = None
    event: OffloadingEvent | None = None

    @classmethod
    def of(cls, job: _Job) -> _Summary:
        n = len(job.keys)
        # The common case in C (this runs holding the GIL the scheduler wants).
        # ``ok`` is the job's own key list (never mutated): no copy.
        if job.is_load and job.outcomes.count(None) == n:
            return cls(job.keys, [], frame_bytes=sum(job.stored_bytes))
        if not job.is_load and job.outcomes.count(True) == n:
            return cls(job.keys, [], written=n, frame_bytes=sum(job.stored_bytes))
        s = cls([], [])
        for key, res, nbytes in zip(job.keys, job.outcomes, job.stored_bytes, strict=True):
            if not isinstance(res, BaseException):
                s.ok.append(key)
                if res is False and not job.is_load:
                    s.existed += 1
                else:
                    s.written += not job.is_load
                    s.frame_bytes += nbytes
                continue
            s.bad.append(key)
            if isinstance(res, ObjectMissing):
                s.missing += 1
            elif isinstance(res, ObjectCorrupt):
                s.corrupt += 1
                s.first_corrupt = s.first_corrupt or res
            else:
                s.transient += isinstance(res, TransientError) or job.is_load
                s.first_error = s.first_error or res
        return s


class _TouchJob(PoolJob):
    """Background refresh of recency/expiry (``Backend.touch_many``); no vLLM job."""

    __slots__ = ("backend", "names")

    def __init__(self, backend: Backend, names: list[str]) -> None:
        super().__init__(-1, len(names), len(names))
        self.backend = backend
        self.names = names

    def run(self, ctx: FrameCodec, start: int, stop: int) -> None:
        with contextlib.suppress(Exception):  # best effort: a failed touch only ages a key
            self.backend.touch_many(self.names[start:stop])

    def cancel(self, start: int, stop: int) -> None:
        return


_CLOSED = BreakerState.CLOSED


class _BackendLookup(AsyncLookupManager):
    """vLLM's AsyncLookupManager over ``Backend.exists_many`` (worker thread)."""

    def __init__(self, tier: KVStoreTier, tier_type: str) -> None:
        super().__init__(tier_type=tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> list[bool]:
        names = [self._tier.namespace.object_name(k) for k in keys]
        # A list, never a generator: vLLM 0.32 iterates it outside its try.
        return [bool(x) for x in self._tier.backend.exists_many(names)]


class KVStoreTier(SecondaryTierManager):
    """Secondary tier backed by a kvstore :class:`Backend`.

    Subclasses set ``backend_cls``. Constructor keys are the backend's
    ``config_model`` fields (every key of the tier dict except ``type``,
    ``module_path`` and ``backpressure``); a bad key fails startup with a
    :class:`~kvstore_tiers.errors.ConfigError` naming it.
    """

    backend_cls: ClassVar[type[Backend]]
    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any | None = None,
        **tier_kwargs: Any,
    ) -> None:
        from kvstore_tiers.log import attach_to_vllm_logging

        attach_to_vllm_logging()
        backend_cls = self.backend_cls
        config: TierConfig = validate_config(backend_cls.config_model, tier_type, tier_kwargs)
        if backpressure_detector is None and backend_cls.remote:
            from kvstore_tiers.compat import make_default_remote_detector

            backpressure_detector = make_default_remote_detector(
                tier_type, config.failure_threshold
            )
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.config = config
        self.locality = Locality(config.locality or ("REMOTE" if backend_cls.remote else "LOCAL"))
        from kvstore_tiers.crypto import PayloadCipher, load_key

        key = load_key(config.encryption_key_env, config.encryption_key_file)
        cipher = PayloadCipher(key) if key is not None else None
        del key  # only the cipher object holds it from here on
        salt = config.namespace_salt
        if cipher is not None:
            # Different keys -> different namespaces: tenants never address (or
            # delete as corrupt) each other's objects; a rotation starts fresh.
            salt = f"{salt or ''}|key:{cipher.key_id}"
        self.encrypted = cipher is not None
        self.namespace = Namespace.from_offloading_spec(offloading_spec, salt)
        self.codec_id = resolve_compression(
            config.compression, remote=backend_cls.remote, dtype_bytes=self.namespace.dtype_bytes
        )
        self._num_chunks = int(primary_kv_view.shape[0]) if primary_kv_view.shape else 0
        self.backend: Backend = backend_cls(config, self.namespace)
        self.backend.open()
        tuning = self.backend.tuning
        self._store_batch = tuning.store_batch
        self._load_batch = tuning.load_batch
        if tuning.max_load_batch_bytes:
            self._load_batch = max(1, min(self._load_batch, tuning.max_load_batch_bytes
                                          // max(1, self._block_size_bytes)))
        self._spread_loads = tuning.spread_loads
        self._read_threads = max(1, config.n_read_threads)
        self._closed = False
        self._flat: memoryview | None = primary_kv_view.cast("B")

        self.metrics = TierMetrics(label=tier_type)
        self.breaker = CircuitBreaker(
            tier_type, config.failure_threshold, config.breaker_cooldown_s
        )
        self._warn = RateLimitedLogger(logger, interval_s=30.0)
        self._presence = PresenceIndex(config.presence_capacity)
        #: Load jobs with a deadline still in flight (scanned by get_finished_jobs).
        self._deadlined: dict[int, _Job] = {}
        #: Load jobs reported failed at their deadline while an I/O thread still ran.
        self.load_timeouts = 0
        self._bounce_local = threading.local()
        self._failed_by_req: dict[str, set[bytes]] = {}
        self._ready: deque[JobResult] = deque()

        self.events: list[OffloadingEvent] | None = None
        if config.enable_kv_events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self.events = []
            else:
                logger.warning(
                    "enable_kv_events is set on tier '%s' but KV cache events are disabled "
                    "globally; the tier will not emit events.", tier_type,
                )

        namespace, codec_id, align = self.namespace.digest, self.codec_id, tuning.header_align
        self._pool = IOPool(
            config.n_read_threads, config.n_write_threads, config.max_queued_chunks,
            ctx_factory=lambda: FrameCodec(namespace, codec_id, align, cipher),
            name=f"kvstore_{tier_type}",
            store_poll_s=config.store_poll_ms / 1000, store_linger_s=config.store_linger_s,
        )
        self._lookup = _BackendLookup(self, tier_type)
        logger.info(
            "kvstore tier '%s' ready: %s, namespace %s, codec %s, chunk %d bytes x %d rows, "
            "%d+%d I/O threads, locality %s",
            tier_type, self.backend.describe(), self.namespace.name, self.codec_id.name.lower(),
            self._block_size_bytes, self._num_chunks, config.n_read_threads,
            config.n_write_threads, self.locality.value,
        )

    # ------------------------------------------------------------------ vLLM API
    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        return metric_definitions()

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        try:
            # The common case in few attribute lookups and calls: vLLM calls
            # this for every block of every waiting request, every step. No
            # failed loads anywhere, circuit closed, and the key stored by
            # this process: HIT.
            if self._failed_by_req:
                failed = self._failed_by_req.get(req_context.req_id)
                if failed and key in failed:
                    return LookupResult.MISS
            breaker = self.breaker
            if breaker.state is not _CLOSED and breaker.is_open:
                return LookupResult.MISS
            if self._presence.stored(key):
                return LookupResult.HIT
            found = self._lookup.lookup(key, req_context)
            if found is None:
                return LookupResult.RETRY
            if not found:
                return LookupResult.MISS
            self._presence.add(key)  # known to exist: later lookups and stores skip the check
            return LookupResult.HIT
        except Exception:
            logger.exception("kvstore tier %s: lookup failed; answering MISS", self.tier_type)
            return LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        try:
            self._submit(job_metadata, is_load=False)
        except Exception:
            logger.exception("kvstore tier %s: submit_store failed", self.tier_type)
            self._fail_now(job_metadata.job_id, job_metadata, is_load=False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        try:
            self._submit(job_metadata, is_load=True)
        except Exception:
            logger.exception("kvstore tier %s: submit_load failed", self.tier_type)
            self._fail_now(job_metadata.job_id, job_metadata, is_load=True)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results: list[JobResult] = []
        try:
            while self._ready:
                results.append(self._ready.popleft())
            finished = self._pool.finished
            while finished:
                job = finished.popleft()
                if not isinstance(job, _Job) or job.reported:
                    continue  # a background touch, or a job already failed at its deadline
                if job.deadline is not None:
                    self._deadlined.pop(job.job_id, None)
                job.reported = True
                try:
                    results.append(self._complete(job))
                except Exception:
                    # A job popped here must still be reported, or vLLM waits on it forever.
                    logger.exception("kvstore tier %s: completing job %d failed; reporting "
                                     "it failed", self.tier_type, job.job_id)
                    results.append(self._failed_result(job))
            if self._deadlined:
                now = time.monotonic()
                for job in [j for j in self._deadlined.values() if now > (j.deadline or now)]:
                    results.append(self._expire(job))
        except Exception:
            logger.exception("kvstore tier %s: get_finished_jobs failed", self.tier_type)
        return results

    def take_events(self) -> Iterable[OffloadingEvent]:
        if not self.events:
            return ()
        events, self.events = self.events, []
        return events

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Refresh recency/expiry of blocks the primary just reused, in the background.

        Only for backends that override ``touch_many`` (e.g. redis ``ttl_s``,
        fs LRU); the batch goes to the I/O pool, or is dropped if it is full.
        """
        try:
            if not type(self.backend).supports_touch or not keys:
                return
            names = [self.namespace.object_name(k) for k in keys if k in self._presence]
            if names:
                self._pool.submit(_TouchJob(self.backend, names), is_load=False)
        except Exception:
            logger.exception("kvstore tier %s: touch failed", self.tier_type)

    def on_request_finished(self, req_context: ReqContext) -> None:
        try:
            self._lookup.cleanup(req_context.req_id)
            self._failed_by_req.pop(req_context.req_id, None)
        except Exception:
            logger.exception("kvstore tier %s: on_request_finished failed", self.tier_type)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        try:
            self._lookup.flush()
        except Exception:
            logger.exception("kvstore tier %s: on_schedule_end failed", self.tier_type)

    def drain_jobs(self) -> None:
        """Cancel queued transfers (they report failure) and wait for running ones."""
        try:
            self._pool.cancel_queued()
            self._pool.wait_idle()
        except Exception:
            logger.exception("kvstore tier %s: drain_jobs failed", self.tier_type)

    def get_stats(self) -> Any:
        try:
            return self.metrics.collect(self._gauges())
        except Exception:
            logger.exception("kvstore tier %s: get_stats failed", self.tier_type)
            return None

    def shutdown(self) -> None:
        """Stop lookups and I/O threads, close the backend, drop views of the primary."""
        if self._closed:
            return
        self._closed = True
        for step in (self._lookup.shutdown, self._pool.shutdown, self.backend.close):
            try:
                step()
            except Exception:
                logger.exception("kvstore tier %s: error during shutdown", self.tier_type)
        if self._flat is not None:
            with contextlib.suppress(Exception):
                self._flat.release()
            self._flat = None
        self._write_stats_file()
        c = self.metrics.counters
        logger.info(
            "kvstore tier '%s' shut down: %d objects stored (%d skipped), %d loaded, "
            "%d corrupt, %d store / %d load failures, %d dropped",
            self.tier_type, c.objects_stored, c.objects_skipped, c.objects_loaded,
            c.corrupt_objects, c.store_failures, c.load_failures, c.stores_dropped,
        )

    # ------------------------------------------------------------- inspection
    @property
    def counters(self) -> Any:
        """Cumulative counters of this tier (process lifetime)."""
        return self.metrics.counters

    def __repr__(self) -> str:
        return f"{type(self).__name__}(type={self.tier_type!r}, {self.backend.describe()})"

    # ---------------------------------------------------------------- internals
    def _gauges(self) -> dict[str, float]:
        self.metrics.counters.objects_evicted = self.backend.evicted_objects
        state = self.breaker.state
        return {
            "healthy": float(state is BreakerState.CLOSED),
            "circuit_state": float(int(state)),
            "queued_chunks": float(self._pool.queued_chunks),
        }

    def _fail_now(self, job_id: int, job: TransferJob, is_load: bool) -> None:
        """Report a job failed at the next get_finished_jobs (never raises)."""
        try:
            n = len(job.keys)
            if is_load:
                self._fail_loads(job.req_context.req_id, job.keys)
            else:
                self.metrics.counters.stores_dropped += n
        finally:
            self._ready.append(JobResult(job_id=job_id, success=False))

    def _submit(self, tj: TransferJob, is_load: bool) -> None:
        # Scheduler thread: keep this to bulk operations; the I/O threads
        # split the job, name the objects and condense the outcomes.
        # vLLM's own list, not a copy (see _Job); any other collection is copied.
        keys = tj.keys if type(tj.keys) is list else list(tj.keys)
        cids = tj.chunk_ids
        cids = cids.tolist() if isinstance(cids, np.ndarray) else [int(c) for c in cids]
        if len(cids) != len(keys) or (
            cids and (min(cids) < 0 or max(cids) >= self._num_chunks)
        ):
            self._warn.warning(
                "bad-chunk", "kvstore tier %s: job %d has chunk ids outside [0, %d); failing it",
                self.tier_type, tj.job_id, self._num_chunks,
            )
            self._fail_now(tj.job_id, tj, is_load)
            return
        if self._closed or not self.breaker.allow():
            self._fail_now(tj.job_id, tj, is_load)
            return
        if not is_load and self._presence.holds_any(keys):
            keys, cids = self._drop_present(keys, cids)
        if not keys:
            self._ready.append(JobResult(job_id=tj.job_id, success=True, transfer_time=0.0))
            return
        timeout = self.config.load_timeout_s
        # The job is queued once; I/O threads take it a batch at a time, so a
        # request's chunks move in parallel at no cost to this thread. Stores
        # go ``tuning.store_batch`` chunks per task, loads ``tuning.load_batch`` (fs:
        # eight; a pipeline's worth for redis/s3) -- with ``spread_loads``
        # (fs) a load is first spread over every read thread, as it sits on
        # time-to-first-token.
        batch = self._store_batch
        if is_load:
            batch = self._load_batch
            if self._spread_loads:
                batch = min(batch, -(-len(keys) // self._read_threads))
        job = _Job(
            self, tj.job_id, is_load=is_load, req_id=tj.req_context.req_id, keys=keys,
            cids=cids, submit_time=tj.submit_time,
            deadline=time.monotonic() + timeout if is_load and timeout else None,
            batch=batch,
        )
        if not is_load:
            # In the index at once (later stores of these keys skip), stored
            # for lookups once the job's completion sets its ``done``.
            self._presence.update(keys, job)
        if job.deadline is not None:
            self._deadlined[tj.job_id] = job
        if not self._pool.submit(job, is_load):
            self._deadlined.pop(tj.job_id, None)
            if not is_load:
                self._presence.discard_receipt(keys, job)
            self._warn.warning(
                "queue-full", "kvstore tier %s: I/O queue full (%d chunks); failing job",
                self.tier_type, self._pool.queued_chunks,
            )
            self._fail_now(tj.job_id, tj, is_load)

    def _drop_present(self, keys: Sequence[bytes], cids: list[int]
                      ) -> tuple[list[bytes], list[int]]:
        """Scheduler thread: skip blocks already stored or in flight (both in the index).

        Its own method, not inline in ``_submit``: a comprehension over
        ``_submit``'s locals makes them cells, three objects ``_submit``
        would allocate on every call.
        """
        presence = self._presence
        todo = [i for i, k in enumerate(keys) if k not in presence]
        self.metrics.counters.objects_skipped += len(keys) - len(todo)
        return [keys[i] for i in todo], [cids[i] for i in todo]

    def _row(self, chunk_id: int) -> memoryview:
        assert self._flat is not None
        off = chunk_id * self._block_size_bytes
        return self._flat[off : off + self._block_size_bytes]

    def _run_slots(self, job: _Job, codec: FrameCodec, start: int, stop: int) -> None:
        """On an I/O thread: move slots ``[start, stop)`` of ``job``, record outcomes."""
        try:
            if job.is_load and job.deadline is not None:
                self._run_deadlined_load(job, codec, start, stop)
                return
            name_of = self.namespace.object_name
            keys = job.keys[start:stop]
            rows = [self._row(c) for c in job.cids[start:stop]]
            if job.is_load:
                items = [LoadItem(name_of(k), k, r) for k, r in zip(keys, rows, strict=True)]
                results = self.backend.load_many(items, codec)
                for s, item, res in zip(range(start, stop), items, results, strict=True):
                    if isinstance(res, BaseException):
                        job.outcomes[s] = detached(res)
                        if isinstance(res, ObjectCorrupt):
                            self._remove_corrupt(item.name)
                    else:
                        job.stored_bytes[s] = res
            else:
                sitems = [StoreItem(name_of(k), k, r) for k, r in zip(keys, rows, strict=True)]
                results = self.backend.store_many(sitems, codec)
                for s, res in zip(range(start, stop), results, strict=True):
                    if isinstance(res, BaseException):
                        job.outcomes[s] = detached(res)
                    else:
                        job.outcomes[s] = res > 0
                        job.stored_bytes[s] = res
        except Exception as exc:
            # The batch call itself failed: no slot of it can be trusted.
            err = detached(classify(exc))
            for s in range(start, stop):
                job.outcomes[s] = err

    def _bounce(self, n_rows: int) -> mmap.mmap:
        """I/O thread: this thread's page-aligned scratch of at least ``n_rows`` rows.

        Anonymous mmap memory is page aligned, so O_DIRECT reads into it work
        exactly as into the (aligned) primary rows.
        """
        need = max(1, n_rows * self._block_size_bytes)
        buf: mmap.mmap | None = getattr(self._bounce_local, "buf", None)
        if buf is None or len(buf) < need:
            # The old buffer is dropped, not closed: views of it may still be alive.
            buf = self._bounce_local.buf = mmap.mmap(-1, need)
        return buf

    def _run_deadlined_load(self, job: _Job, codec: FrameCodec, start: int, stop: int) -> None:
        """I/O thread: load into a bounce buffer, then copy rows in unless expired."""
        if job.expired or time.monotonic() > (job.deadline or 0.0):
            raise TimeoutError("load deadline passed before the transfer started")
        row = self._block_size_bytes
        # Views of the scratch are not released explicitly: a codec may still
        # hold an export of them; the mmap lives as long as this thread.
        scratch = memoryview(self._bounce(stop - start))
        name_of = self.namespace.object_name
        items = [LoadItem(name_of(k), k, scratch[i * row : (i + 1) * row])
                 for i, k in enumerate(job.keys[start:stop])]
        results = self.backend.load_many(items, codec)
        late = TimeoutError("load finished after its deadline; discarded")
        for s, item, res in zip(range(start, stop), items, results, strict=True):
            if isinstance(res, BaseException):
                job.outcomes[s] = detached(res)
                if isinstance(res, ObjectCorrupt):
                    self._remove_corrupt(item.name)
                continue
            job.stored_bytes[s] = res
            assert job.lock is not None  # a deadlined job has one from the start
            with job.lock:  # see the deadline protocol in the module docstring
                if job.expired:
                    job.outcomes[s] = late
                    continue
                self._row(job.cids[s])[:] = item.dest
                job.landed[s] = True
                job.outcomes[s] = None

    def _expire(self, job: _Job) -> JobResult:
        """Scheduler thread: report a load job failed at its deadline (never blocks long).

        After the lock is released no I/O thread writes this job's rows again;
        rows that landed before are reported as loaded.
        """
        assert job.lock is not None  # only loads with a deadline expire
        with job.lock:
            job.expired = True
            landed = list(job.landed)
        self._deadlined.pop(job.job_id, None)
        job.reported = True
        ok = [k for k, done in zip(job.keys, landed, strict=True) if done]
        bad = [k for k, done in zip(job.keys, landed, strict=True) if not done]
        c = self.metrics.counters
        c.objects_loaded += len(ok)
        c.raw_bytes_read += len(ok) * self._block_size_bytes
        self.metrics.observe("load_seconds", time.monotonic() - job.submit_time)
        if not bad:
            self.breaker.record(True)
            return JobResult(job_id=job.job_id, success=True, transfer_time=job.transfer_time)
        self.load_timeouts += 1
        self.breaker.record(False)
        for k in bad:
            self._presence.discard(k)
        self._fail_loads(job.req_id, bad)
        self._warn.warning(
            "load-timeout", "kvstore tier %s: load of %d blocks passed its %.3fs deadline; "
            "reported failed (vLLM recomputes)", self.tier_type, len(bad),
            self.config.load_timeout_s or 0.0,
        )
        return JobResult(job_id=job.job_id, success=False, successful_keys=tuple(ok) or None,
                         transfer_time=job.transfer_time)


    def _remove_corrupt(self, name: str) -> None:
        """I/O thread: delete a corrupt object so no later lookup finds it."""
        try:
            self.backend.delete(name)
        except Exception as exc:
            self._warn.warning(
                "corrupt-delete", "kvstore tier %s: could not remove corrupt object %s: %s",
                self.tier_type, name, exc,
            )

    def _summarise(self, job: _Job) -> _Summary:
        """I/O thread: condense a finished job, with its JobResult and kv event ready.

        Reads only the job and the tier's constants, never scheduler state.
        """
        s = _Summary.of(job)
        if not job.is_load:
            s.result = JobResult(
                job_id=job.job_id, success=not s.bad, transfer_time=job.transfer_time,
                transfer_bytes=len(job.keys) * self._block_size_bytes,
            )
            if self.events is not None and s.ok:
                s.event = OffloadingEvent(
                    keys=s.ok, medium=self.medium, removed=False, locality=self.locality,
                )
        elif s.bad:
            s.result = JobResult(
                job_id=job.job_id, success=False, successful_keys=tuple(s.ok) or None,
                transfer_time=job.transfer_time,
            )
        else:
            s.result = JobResult(job_id=job.job_id, success=True, transfer_time=job.transfer_time)
        return s

    def _fail_loads(self, req_id: str, keys: Collection[bytes]) -> None:
        """Scheduler thread: count ``keys`` as failed loads of request ``req_id``
        (its later lookups of them answer MISS: vLLM issue 49176)."""
        self.metrics.counters.load_failures += len(keys)
        self._failed_by_req.setdefault(req_id, set()).update(keys)

    def _failed_result(self, job: _Job) -> JobResult:
        """Scheduler thread: report ``job`` failed as a whole (its outcomes are unusable)."""
        if job.is_load:
            self._fail_loads(job.req_id, job.keys)
        else:
            self.metrics.counters.store_failures += len(job.keys)
            self._presence.discard_receipt(job.keys, job)
            job.release()
        return JobResult(job_id=job.job_id, success=False)

    def _complete(self, job: _Job) -> JobResult:
        """Scheduler thread: apply a finished job's summary, return vLLM's JobResult."""
        s = job.summary or self._summarise(job)
        assert s.result is not None
        c = self.metrics.counters
        row = self._block_size_bytes
        elapsed = time.monotonic() - job.submit_time
        self.breaker.record(s.transient == 0)
        if not job.is_load:
            # No per-key work for stored keys (see kvstore_tiers.presence):
            # the job, their receipt, makes all of them stored; failed ones
            # are forgotten.
            job.done = True
            if s.bad:
                self._presence.discard_receipt(s.bad, job)
            c.objects_skipped += s.existed
            c.objects_stored += s.written
            c.raw_bytes_written += s.written * row
            c.stored_bytes_written += s.frame_bytes
            c.store_failures += len(s.bad)
            self.metrics.observe("store_seconds", elapsed)
            if s.bad:
                self._warn.warning(
                    "store-failed", "kvstore tier %s: %d of %d stores failed: %s",
                    self.tier_type, len(s.bad), len(job.keys), s.first_error or s.first_corrupt,
                )
            if s.event is not None and self.events is not None:
                self.events.append(s.event)
            result = s.result
            job.release()
            return result

        # Loaded keys are in the presence index already: stored by this
        # process, or added when the existence check found them.
        c.objects_loaded += len(s.ok)
        c.raw_bytes_read += len(s.ok) * row
        c.stored_bytes_read += s.frame_bytes
        self.metrics.observe("load_seconds", elapsed)
        if not s.bad:
            return s.result
        for key in s.bad:
            self._presence.discard(key)
        c.load_misses += s.missing
        c.corrupt_objects += s.corrupt
        c.load_failures += s.transient
        if s.corrupt:
            self._warn.warning(
                "corrupt", "kvstore tier %s: rejected %d corrupt object(s) (%s); removed, "
                "they will be recomputed", self.tier_type, s.corrupt, s.first_corrupt,
            )
        if s.transient:
            self._warn.warning(
                "load-failed", "kvstore tier %s: %d load(s) failed: %s",
                self.tier_type, s.transient, s.first_error,
            )
        self._failed_by_req.setdefault(job.req_id, set()).update(s.bad)
        return s.result

    def _write_stats_file(self) -> None:
        directory = os.environ.get(STATS_DIR_ENV)
        if not directory:
            return
        try:
            os.makedirs(directory, exist_ok=True)
            path = os.path.join(directory, f"{self.tier_type}-{os.getpid()}-{id(self):x}.json")
            with open(path, "w") as f:
                json.dump({"tier_type": self.tier_type, "backend": self.backend.describe(),
                           "namespace": self.namespace.name,
                           "counters": self.metrics.counters.as_dict()}, f, indent=2)
        except OSError as exc:
            logger.warning("kvstore tier %s: could not write stats file: %s", self.tier_type, exc)

