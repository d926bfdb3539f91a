"""The load trace: when each phase of each load job ran, to find where a load's time goes.

Off unless the environment variable ``KVSTORE_TIERS_LOAD_TRACE`` names a
file when a tier starts (read once, then; :func:`start`). Off, the tier's
:class:`~kvstore_tiers.job.TransferContext` holds ``trace=None`` and each
hot path pays one ``is None`` test of a field it already has: nothing is
allocated, on vLLM's scheduler thread or elsewhere.

On, each phase appends one tuple to the tier's in-memory list (a list append
is atomic: no lock), stamped with ``time.monotonic()``, the clock of vLLM's
``TransferJob.submit_time``:

* the I/O thread running a load batch: when it took the batch, when the
  backend's batch call (``load_many``) started and returned, when the batch
  was done (rows landed), and the marks made inside that call
  (:meth:`LoadTrace.mark`, by :func:`kvstore_tiers.batching.load_many`:
  ``read`` as the backend's reads start, ``read_end`` when the first one
  completes -- for fs, its one GIL-free read, which also checksums the rows
  -- then ``frame`` as each item's frame is verified and decoded);
* the thread finishing the job: when it hands the job to the pool's
  ``finished`` deque (the end of :meth:`Job.finish <kvstore_tiers.job.Job.finish>`,
  which the append follows), with vLLM's submit time;
* vLLM's scheduler thread: when ``get_finished_jobs`` returned the job.

Nothing is written until :meth:`LoadTrace.flush` (the tier's ``shutdown``
calls it; a bench may call it sooner), which appends one JSON line per load
job to the file (:func:`record_of` says what a line holds).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from kvstore_tiers.errors import ConfigError

if TYPE_CHECKING:
    from kvstore_tiers.batching import LoadItem, LoadMany, Result
    from kvstore_tiers.frame import FrameCodec

logger = logging.getLogger(__name__)

#: The file load-trace records are appended to (unset or empty: no trace).
LOAD_TRACE_ENV = "KVSTORE_TIERS_LOAD_TRACE"


class Batch:
    """One load batch's times on its I/O thread (``call``/``call_end``: the
    backend's batch call) and the marks the backend made inside the call."""

    __slots__ = ("call", "call_end", "marks", "start")

    def __init__(self, start: float) -> None:
        self.start = start
        self.call = self.call_end = 0.0
        self.marks: list[tuple[str, float]] = []


class LoadTrace:
    """A tier's load-trace events in memory until :meth:`flush` appends them to ``path``."""

    def __init__(self, path: str, tier: str) -> None:
        self.path = path
        self.tier = tier
        self._events: list[tuple[Any, ...]] = []
        self._held: list[tuple[Any, ...]] = []  # events of jobs not yet picked up (flush)
        self._local = threading.local()  # the batch open on this thread
        self._flush_lock = threading.Lock()

    # -- I/O threads ---------------------------------------------------------------
    @contextlib.contextmanager
    def batch(self, job_id: int, start: int, stop: int, load_many: LoadMany
              ) -> Iterator[LoadMany]:
        """Slots ``[start, stop)`` of load ``job_id`` run on this thread inside the
        block: it gets ``load_many`` (the backend's batch call) timed, and the
        marks this thread makes meanwhile go to this batch."""
        batch = self._local.batch = Batch(time.monotonic())

        def timed(items: Sequence[LoadItem], codec: FrameCodec) -> list[Result]:
            batch.call = time.monotonic()
            try:
                return load_many(items, codec)
            finally:
                batch.call_end = time.monotonic()

        try:
            yield timed
        finally:
            self._local.batch = None
            self._events.append(("batch", job_id, threading.current_thread().name, start,
                                 stop, batch.start, batch.call, batch.call_end,
                                 time.monotonic(), batch.marks))

    def mark(self, stage: str) -> None:
        """Inside a load batch call: ``stage`` happened now (no batch open: ignored)."""
        batch = getattr(self._local, "batch", None)
        if batch is not None:
            batch.marks.append((stage, time.monotonic()))

    def published(self, job_id: int, chunks: int, submit_time: float, ok: bool) -> None:
        """The finishing thread hands load ``job_id`` to the pool's ``finished`` deque."""
        self._events.append(("published", job_id, threading.current_thread().name, chunks,
                             submit_time, ok, time.monotonic()))

    # -- the scheduler thread ------------------------------------------------------
    def picked(self, results: Sequence[Any]) -> None:
        """``get_finished_jobs`` returns ``results`` (vLLM's JobResults) now."""
        if results:
            self._events.append(("picked", time.monotonic(), [r.job_id for r in results]))

    # -- off the hot paths (file I/O): the tier's shutdown, or a bench -------------
    def flush(self, final: bool = False) -> int:
        """Append one JSON line per load job picked up so far (``final``: every
        job seen, picked up or not) to the file; returns how many lines.

        Never raises: a file that cannot be written is logged, and its records
        are dropped."""
        with self._flush_lock:
            n = len(self._events)
            events = self._held + self._events[:n]
            del self._events[:n]  # appends since the copy stay, after index n
            records, self._held = group(events, final)
            if not records:
                return 0
            pid = os.getpid()
            lines = "".join(json.dumps({"pid": pid, "tier": self.tier, **r}) + "\n"
                            for r in records)
            try:
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(lines)
            except OSError as exc:
                logger.warning("kvstore tier %s: could not write the load trace to %s: %s",
                               self.tier, self.path, exc)
            return len(records)

    def close(self) -> None:
        """At the tier's shutdown: write every job's record, picked up or not."""
        self.flush(final=True)


def group(events: list[tuple[Any, ...]], final: bool
          ) -> tuple[list[dict[str, Any]], list[tuple[Any, ...]]]:
    """(records of the load jobs picked up, or of every load job when ``final``;
    the events of the others, held for a later flush).

    A pick-up names every job ``get_finished_jobs`` returned, stores too: ids
    with no load events here are dropped. (So a load reported failed at its
    deadline before its I/O thread was done, flushed in between, has no
    pick-up time.)"""
    by_job: dict[int, list[tuple[Any, ...]]] = {}
    picked_at: dict[int, float] = {}
    for ev in events:
        if ev[0] != "picked":
            by_job.setdefault(ev[1], []).append(ev)
    for ev in events:
        if ev[0] == "picked":
            for job_id in ev[2]:
                if job_id in by_job:
                    picked_at.setdefault(job_id, ev[1])
    records, held = [], []
    for job_id, evs in by_job.items():
        if job_id in picked_at or final:
            records.append(record_of(job_id, evs, picked_at.get(job_id)))
        else:
            held += evs
    return sorted(records, key=lambda r: r["submit"] or 0.0), held


def record_of(job_id: int, events: list[tuple[Any, ...]], picked: float | None
              ) -> dict[str, Any]:
    """One job's line: ``job``, ``chunks``, ``ok``, ``submit`` (vLLM's submit
    time), ``batches`` (each: ``thread``, ``slots`` [start, stop), ``start``,
    ``call``, ``call_end``, ``end``, ``marks`` [[stage, time], ...]),
    ``published`` (and ``published_by``: the thread) and ``picked``; all times
    ``time.monotonic()`` seconds, None where the job never got there."""
    rec: dict[str, Any] = {"job": job_id, "chunks": None, "ok": None, "submit": None,
                           "batches": [], "published": None, "published_by": None,
                           "picked": picked}
    for ev in events:
        if ev[0] == "batch":
            _kind, _job, thread, start, stop, t0, call, call_end, end, marks = ev
            rec["batches"].append({"thread": thread, "slots": [start, stop], "start": t0,
                                   "call": call, "call_end": call_end, "end": end,
                                   "marks": [list(m) for m in marks]})
        elif ev[0] == "published":
            _kind, _job, thread, chunks, submit, ok, t = ev
            rec.update(chunks=chunks, ok=ok, submit=submit, published=t, published_by=thread)
    rec["batches"].sort(key=lambda b: b["start"])
    return rec


def start(tier: str) -> LoadTrace | None:
    """The tier's load trace if ``KVSTORE_TIERS_LOAD_TRACE`` names a file (read
    here, once), else None. A file whose directory does not exist, or cannot
    be written, fails the tier's start with a message naming the variable."""
    path = os.environ.get(LOAD_TRACE_ENV, "")
    if not path:
        return None
    path = os.path.abspath(os.path.expanduser(path))
    directory = os.path.dirname(path)
    if not os.path.isdir(directory) or not os.access(directory, os.W_OK):
        raise ConfigError(f"{LOAD_TRACE_ENV}={path}: the directory {directory} does not exist "
                          "or is not writable")
    logger.info("kvstore tier %s: tracing load jobs to %s (written at shutdown)", tier, path)
    return LoadTrace(path, tier)
