"""What a finished transfer means: its :class:`Summary`, and the expiry of a late load.

A job's summary is condensed once, by the I/O thread that accounts its last
slot (:func:`summarise`, called from :meth:`Job.finish
<kvstore_tiers.job.Job.finish>`), with vLLM's ``JobResult`` and kv event
ready, so the scheduler thread (:mod:`kvstore_tiers.ledger`) applies a
finished job with a few bulk operations. :func:`expire` is the scheduler
side of the load-deadline protocol (:mod:`kvstore_tiers.job`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.v1.kv_offload.base import OffloadingEvent
from vllm.v1.kv_offload.tiering.base import JobResult

from kvstore_tiers.errors import Cancelled, ObjectCorrupt, ObjectMissing, TransientError

if TYPE_CHECKING:
    from kvstore_tiers.job import Job

@dataclass(slots=True)
class Summary:
    """A finished job's outcomes, condensed off the scheduler thread."""

    ok: list[bytes]  # stored (written or already there) / loaded
    bad: list[bytes]  # failed (cancelled ones included)
    #: Stores: not admitted (neither stored nor failed); empty: every block was offered.
    skipped: list[bytes] | tuple[()] = ()
    written: int = 0  # stores that wrote an object
    existed: int = 0  # stores that found the object already there
    frame_bytes: int = 0  # frame bytes written (new objects) or read (loaded)
    missing: int = 0  # loads: object gone
    corrupt: int = 0  # loads: object rejected (and removed)
    transient: int = 0  # I/O or service errors (they feed the circuit breaker)
    cancelled: int = 0  # cancelled before they started (never feed the breaker)
    #: Loads: the keys of the cancelled slots (their objects are untouched).
    cancelled_keys: list[bytes] | tuple[()] = ()
    first_error: BaseException | None = None
    first_corrupt: BaseException | None = None
    #: vLLM's records, built on the finishing I/O thread (see :func:`summarise`).
    result: JobResult | None = None
    event: OffloadingEvent | None = None

    @classmethod
    def of(cls, job: Job) -> Summary:
        n = len(job.keys)
        # The common case in C (this runs holding the GIL the scheduler wants).
        # ``ok`` is the job's own key list (never mutated): no copy.
        if job.is_load and job.outcomes.count(None) == n:
            return cls(job.keys, [], frame_bytes=sum(job.stored_bytes))
        if not job.is_load and job.outcomes.count(True) == n:
            return cls(job.keys, [], job.declined, written=n, frame_bytes=sum(job.stored_bytes))
        s = cls([], [], job.declined, cancelled_keys=[] if job.is_load else ())
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
            if isinstance(res, Cancelled):
                s.cancelled += 1
                if job.is_load:
                    s.cancelled_keys.append(key)  # type: ignore[union-attr]
            elif isinstance(res, ObjectMissing):
                s.missing += 1
            elif isinstance(res, ObjectCorrupt):
                s.corrupt += 1
                s.first_corrupt = s.first_corrupt or res
            else:
                s.transient += isinstance(res, TransientError) or job.is_load
                s.first_error = s.first_error or res
        return s


def summarise(job: Job) -> Summary:
    """Condense a finished job, with its JobResult and kv event ready.

    Runs on the finishing I/O thread; reads only the job and its context.
    """
    ctx = job.ctx
    s = Summary.of(job)
    if not job.is_load:
        # Only the blocks admitted moved. None: bytes and time 0, which
        # vLLM's backpressure detector ignores rather than counting as a
        # store that took no time.
        moved = job.n_slots
        s.result = JobResult(
            job_id=job.job_id, success=not s.bad,
            transfer_time=job.transfer_time if moved else 0.0,
            transfer_bytes=moved * ctx.rows.row_bytes,
        )
        if ctx.emit_events and s.ok:
            s.event = OffloadingEvent(
                keys=s.ok, medium=ctx.medium, removed=False, locality=ctx.locality,
            )
    elif s.bad:
        s.result = JobResult(
            job_id=job.job_id, success=False, successful_keys=tuple(s.ok) or None,
            transfer_time=job.transfer_time,
        )
    else:
        s.result = JobResult(job_id=job.job_id, success=True, transfer_time=job.transfer_time)
    return s


# -- on the scheduler thread -------------------------------------------------------------
def nothing_stored(job_id: int) -> JobResult:
    """The result of a store job that wrote nothing and failed nothing.

    ``transfer_bytes=0``: vLLM's backpressure detector ignores such a result
    rather than counting it as a store that took no time.
    """
    return JobResult(job_id=job_id, success=True, transfer_time=0.0, transfer_bytes=0)


def expire(job: Job) -> tuple[list[bytes], list[bytes]]:
    """Mark a deadlined load ``expired``; its (landed, not landed) keys.

    Holds the job's lock for at most one row copy. After it returns no I/O
    thread writes this job's rows again (module docstring).
    """
    assert job.lock is not None  # only loads with a deadline expire
    with job.lock:
        job.expired = True
        landed = list(job.landed)
    job.reported = True
    ok = [k for k, done in zip(job.keys, landed, strict=True) if done]
    bad = [k for k, done in zip(job.keys, landed, strict=True) if not done]
    return ok, bad
