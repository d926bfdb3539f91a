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
* Scheduler-owned state (``_jobs``, ``_storing``, ``_presence``,
  ``_failed_by_req``, counters, breaker) is touched only on that thread.
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
from kvstore_tiers.errors import ObjectCorrupt, ObjectMissing, TransientError
from kvstore_tiers.frame import FrameCodec
from kvstore_tiers.health import BreakerState, CircuitBreaker
from kvstore_tiers.namespace import Namespace
from kvstore_tiers.pool import IOPool, PoolJob
from kvstore_tiers.presence import PresenceIndex
from kvstore_tiers.ratelimit import RateLimitedLogger
from kvstore_tiers.stats import TierMetrics, metric_definitions

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec

logger = logging.getLogger(__name__)

#: Chunks per store task (at least; a backend's larger max_batch wins).
STORE_BATCH = 4

#: Directory where every tier writes a JSON snapshot of its counters at shutdown.
STATS_DIR_ENV = "KVSTORE_TIERS_STATS_DIR"


class _Job(PoolJob):
    """A vLLM job in flight: the keys the pool moves and their outcomes.

    ``todo`` holds the indexes (into ``keys``/``chunk_ids``) sent to the pool;
    ``outcomes[slot]`` is written by the I/O thread that owns that slot:
    ``None`` (loaded / stored), ``False`` (store skipped, object existed) or
    the backend error.
    """

    __slots__ = ("chunk_ids", "deadline", "expired", "is_load", "keys", "landed", "lock",
                 "outcomes", "reported", "req_id", "stored_bytes", "submit_time", "todo")

    def __init__(
        self, job_id: int, *, is_load: bool, req_id: str, keys: list[bytes],
        chunk_ids: list[int], todo: list[int], submit_time: float,
        deadline: float | None,
    ) -> None:
        super().__init__(job_id)
        self.is_load = is_load
        self.req_id = req_id
        self.keys = keys
        self.chunk_ids = chunk_ids
        self.todo = todo
        self.outcomes: list[Any] = [None] * len(todo)
        self.stored_bytes = [0] * len(todo)  # frame bytes moved, per slot
        self.submit_time = submit_time
        self.deadline = deadline
        # Deadline protocol (module docstring): ``landed[slot]`` and ``expired``
        # change only under ``lock``; ``reported`` is scheduler-thread only.
        self.lock = threading.Lock()
        self.landed = [False] * len(todo)
        self.expired = False
        self.reported = False


@dataclass(eq=False)
class _Task:
    """A batch of a job's chunks for one I/O thread."""

    tier: KVStoreTier
    job: _Job
    slots: list[int]  # positions in job.todo

    @property
    def n_chunks(self) -> int:
        return len(self.slots)

    def run(self, ctx: FrameCodec) -> None:
        self.tier._run_task(self, ctx)

    def cancel(self) -> None:
        err = TransientError("cancelled before it started (drain or shutdown)")
        for s in self.slots:
            self.job.outcomes[s] = err


@dataclass(eq=False)
class _TouchTask:
    """Background refresh of recency/expiry (``Backend.touch_many``); no vLLM job."""

    backend: Backend
    names: list[str]
    job: PoolJob

    @property
    def n_chunks(self) -> int:
        return len(self.names)

    def run(self, ctx: FrameCodec) -> None:
        with contextlib.suppress(Exception):  # best effort: a failed touch only ages a key
            self.backend.touch_many(self.names)

    def cancel(self) -> None:
        return


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
        self._closed = False
        self._flat: memoryview | None = primary_kv_view.cast("B")

        self.metrics = TierMetrics(label=tier_type)
        self.breaker = CircuitBreaker(
            tier_type, config.failure_threshold, config.breaker_cooldown_s
        )
        self._warn = RateLimitedLogger(logger, interval_s=30.0)
        self._presence = PresenceIndex(config.presence_capacity)
        self._jobs: dict[int, _Job] = {}
        #: Load jobs with a deadline still in flight (scanned by get_finished_jobs).
        self._deadlined: dict[int, _Job] = {}
        #: Load jobs reported failed at their deadline while an I/O thread still ran.
        self.load_timeouts = 0
        self._bounce_local = threading.local()
        self._storing: set[bytes] = set()
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

        namespace, codec_id, align = self.namespace.digest, self.codec_id, backend_cls.header_align
        self._pool = IOPool(
            config.n_read_threads, config.n_write_threads, config.max_queued_chunks,
            ctx_factory=lambda: FrameCodec(namespace, codec_id, align, cipher),
            name=f"kvstore_{tier_type}",
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
            failed = self._failed_by_req.get(req_context.req_id)
            if (failed and key in failed) or self.breaker.is_open:
                return LookupResult.MISS
            if key in self._presence:
                return LookupResult.HIT
            found = self._lookup.lookup(key, req_context)
            if found is None:
                return LookupResult.RETRY
            return LookupResult.HIT if found else LookupResult.MISS
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
                self._jobs.pop(job.job_id, None)
                self._deadlined.pop(job.job_id, None)
                job.reported = True
                results.append(self._complete(job))
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
            if type(self.backend).touch_many is Backend.touch_many or not keys:
                return
            names = [self.namespace.object_name(k) for k in keys if k in self._presence]
            if names:
                self._pool.submit([_TouchTask(self.backend, names, PoolJob(-1))], is_load=False)
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
                self.metrics.counters.load_failures += n
                self._failed_by_req.setdefault(job.req_context.req_id, set()).update(job.keys)
            else:
                self.metrics.counters.stores_dropped += n
        finally:
            self._ready.append(JobResult(job_id=job_id, success=False))

    def _submit(self, tj: TransferJob, is_load: bool) -> None:
        keys = list(tj.keys)
        cids: list[int] = np.asarray(tj.chunk_ids).tolist()
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
        if is_load:
            todo = list(range(len(keys)))
        else:
            todo = [
                i for i, k in enumerate(keys) if k not in self._presence and k not in self._storing
            ]
            self.metrics.counters.objects_skipped += len(keys) - len(todo)
            if not todo:
                self._ready.append(JobResult(job_id=tj.job_id, success=True, transfer_time=0.0))
                return
        timeout = self.config.load_timeout_s
        job = _Job(
            tj.job_id, is_load=is_load, req_id=tj.req_context.req_id, keys=keys,
            chunk_ids=cids, todo=todo, submit_time=tj.submit_time,
            deadline=time.monotonic() + timeout if is_load and timeout else None,
        )
        # Loads go one chunk per task (max_batch for pipelining backends) so a
        # request's chunks move in parallel; stores are off the TTFT path, so
        # they are batched by STORE_BATCH to cost the scheduler fewer tasks.
        batch = max(1, self.backend.max_batch if is_load else
                    max(self.backend.max_batch, STORE_BATCH))
        tasks = [_Task(self, job, list(range(s, min(s + batch, len(todo)))))
                 for s in range(0, len(todo), batch)]
        if not is_load:
            self._storing.update(keys[i] for i in todo)
        self._jobs[tj.job_id] = job
        if job.deadline is not None:
            self._deadlined[tj.job_id] = job
        if not self._pool.submit(tasks, is_load):
            self._jobs.pop(tj.job_id, None)
            self._deadlined.pop(tj.job_id, None)
            if not is_load:
                self._storing.difference_update(keys[i] for i in todo)
            self._warn.warning(
                "queue-full", "kvstore tier %s: I/O queue full (%d chunks); failing job",
                self.tier_type, self._pool.queued_chunks,
            )
            self._fail_now(tj.job_id, tj, is_load)

    def _row(self, chunk_id: int) -> memoryview:
        assert self._flat is not None
        off = chunk_id * self._block_size_bytes
        return self._flat[off : off + self._block_size_bytes]

    def _items(self, cls: type[Any], job: _Job, slots: Sequence[int],
               bufs: Iterable[memoryview]) -> list[Any]:
        """LoadItems/StoreItems of ``job``'s ``slots``, with their row buffers."""
        name_of = self.namespace.object_name
        keys = [job.keys[job.todo[s]] for s in slots]
        return [cls(name_of(k), k, buf) for k, buf in zip(keys, bufs, strict=True)]

    def _run_task(self, task: _Task, codec: FrameCodec) -> None:
        """On an I/O thread: move a batch of chunks, record per-chunk outcomes."""
        job = task.job
        try:
            if job.is_load and job.deadline is not None:
                self._run_deadlined_load(task, codec)
                return
            rows = [self._row(job.chunk_ids[job.todo[s]]) for s in task.slots]
            if job.is_load:
                items = self._items(LoadItem, job, task.slots, rows)
                errors = self.backend.load_many(items, codec)
                for s, item, err in zip(task.slots, items, errors, strict=True):
                    job.outcomes[s] = err
                    job.stored_bytes[s] = item.stored_len
                    if isinstance(err, ObjectCorrupt):
                        self._remove_corrupt(item.name)
            else:
                sitems = self._items(StoreItem, job, task.slots, rows)
                results = self.backend.store_many(sitems, codec)
                for s, sitem, res in zip(task.slots, sitems, results, strict=True):
                    job.outcomes[s] = res
                    job.stored_bytes[s] = sitem.stored_len
        except Exception as exc:
            # The batch call itself failed: no slot of it can be trusted.
            err = classify(exc)
            for s in task.slots:
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

    def _run_deadlined_load(self, task: _Task, codec: FrameCodec) -> None:
        """I/O thread: load into a bounce buffer, then copy rows in unless expired."""
        job = task.job
        if job.expired or time.monotonic() > (job.deadline or 0.0):
            raise TimeoutError("load deadline passed before the transfer started")
        row = self._block_size_bytes
        # Views of the scratch are not released explicitly: a codec may still
        # hold an export of them; the mmap lives as long as this thread.
        scratch = memoryview(self._bounce(len(task.slots)))
        items = self._items(LoadItem, job, task.slots,
                            (scratch[i * row : (i + 1) * row] for i in range(len(task.slots))))
        errors = self.backend.load_many(items, codec)
        late = TimeoutError("load finished after its deadline; discarded")
        for s, item, err in zip(task.slots, items, errors, strict=True):
            job.stored_bytes[s] = item.stored_len
            if err is not None:
                job.outcomes[s] = err
                if isinstance(err, ObjectCorrupt):
                    self._remove_corrupt(item.name)
                continue
            with job.lock:  # see the deadline protocol in the module docstring
                if job.expired:
                    job.outcomes[s] = late
                    continue
                self._row(job.chunk_ids[job.todo[s]])[:] = item.dest
                job.landed[s] = True
                job.outcomes[s] = None

    def _expire(self, job: _Job) -> JobResult:
        """Scheduler thread: report a load job failed at its deadline (never blocks long).

        After the lock is released no I/O thread writes this job's rows again;
        rows that landed before are reported as loaded.
        """
        with job.lock:
            job.expired = True
            landed = list(job.landed)
        self._jobs.pop(job.job_id, None)
        self._deadlined.pop(job.job_id, None)
        job.reported = True
        ok = [job.keys[job.todo[s]] for s, done in enumerate(landed) if done]
        bad = [job.keys[job.todo[s]] for s, done in enumerate(landed) if not done]
        c = self.metrics.counters
        c.objects_loaded += len(ok)
        c.raw_bytes_read += len(ok) * self._block_size_bytes
        self.metrics.observe("load_seconds", time.monotonic() - job.submit_time)
        if not bad:
            self.breaker.record(True)
            return JobResult(job_id=job.job_id, success=True, transfer_time=job.transfer_time)
        self.load_timeouts += 1
        c.load_failures += len(bad)
        self.breaker.record(False)
        for k in bad:
            self._presence.discard(k)
        self._failed_by_req.setdefault(job.req_id, set()).update(bad)
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

    def _complete(self, job: _Job) -> JobResult:
        """Scheduler thread: turn a finished pool job into vLLM's JobResult."""
        c = self.metrics.counters
        elapsed = time.monotonic() - job.submit_time
        row = self._block_size_bytes
        transient = 0
        if not job.is_load:
            stored: list[bytes] = []
            failed = 0
            for slot, res in enumerate(job.outcomes):
                key = job.keys[job.todo[slot]]
                self._storing.discard(key)
                if isinstance(res, BaseException):
                    failed += 1
                    transient += isinstance(res, TransientError)
                    self._warn.warning(
                        "store-failed", "kvstore tier %s: store failed: %s", self.tier_type, res
                    )
                    continue
                self._presence.add(key)
                if res is False:
                    c.objects_skipped += 1
                else:
                    c.objects_stored += 1
                    c.raw_bytes_written += row
                    c.stored_bytes_written += job.stored_bytes[slot]
                stored.append(key)
            c.store_failures += failed
            self.metrics.observe("store_seconds", elapsed)
            self.breaker.record(transient == 0)
            if self.events is not None and stored:
                self.events.append(OffloadingEvent(
                    keys=stored, medium=self.medium, removed=False, locality=self.locality,
                ))
            return JobResult(
                job_id=job.job_id, success=failed == 0, transfer_time=job.transfer_time,
                transfer_bytes=len(job.todo) * row,
            )

        ok: list[bytes] = []
        bad: list[bytes] = []
        for slot, err in enumerate(job.outcomes):
            key = job.keys[job.todo[slot]]
            if err is None:
                ok.append(key)
                self._presence.add(key)  # known to exist: later stores skip it
                continue
            bad.append(key)
            self._presence.discard(key)
            if isinstance(err, ObjectMissing):
                c.load_misses += 1
            elif isinstance(err, ObjectCorrupt):
                c.corrupt_objects += 1
                self._warn.warning(
                    "corrupt", "kvstore tier %s: rejected a corrupt object (%s); it was removed "
                    "and will be recomputed", self.tier_type, err,
                )
            else:
                transient += 1
                c.load_failures += 1
                self._warn.warning(
                    "load-failed", "kvstore tier %s: load failed: %s", self.tier_type, err
                )
        c.objects_loaded += len(ok)
        c.raw_bytes_read += len(ok) * row
        c.stored_bytes_read += sum(
            n for n, err in zip(job.stored_bytes, job.outcomes, strict=True) if err is None
        )
        self.metrics.observe("load_seconds", elapsed)
        self.breaker.record(transient == 0)
        if bad:
            self._failed_by_req.setdefault(job.req_id, set()).update(bad)
            return JobResult(
                job_id=job.job_id, success=False, successful_keys=tuple(ok) or None,
                transfer_time=job.transfer_time,
            )
        return JobResult(job_id=job.job_id, success=True, transfer_time=job.transfer_time)

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

