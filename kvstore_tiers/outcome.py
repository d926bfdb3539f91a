"""What a finished transfer means: its :class:`Summary`.

A job's summary is condensed once, by the I/O thread that accounts its last
slot (:meth:`Job.finish <kvstore_tiers.job.Job.finish>`), with vLLM's
``JobResult`` and kv event ready, so the scheduler thread
(:mod:`kvstore_tiers.ledger`) applies a finished job with a few bulk
operations. This module knows the outcomes, not the job: it is given the
job's per-slot lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.v1.kv_offload.base import OffloadingEvent
from vllm.v1.kv_offload.tiering.base import JobResult

from kvstore_tiers.errors import Cancelled, ObjectCorrupt, ObjectMissing, TransientError


class _NotWritten:
    __slots__ = ()

    def __repr__(self) -> str:
        return "NOT_WRITTEN"


#: A store slot's outcome when the job's runner chose not to write it after all
#: (its row no longer held the block): neither stored nor failed, as the blocks a
#: store filter declines; :meth:`Summary.of` adds it to ``unwritten``.
NOT_WRITTEN: Any = _NotWritten()


@dataclass(slots=True)
class Summary:
    """A finished job's outcomes, condensed off the scheduler thread."""

    ok: list[bytes]  # stored (written or already there) / loaded
    bad: list[bytes]  # failed (cancelled ones included)
    #: Stores: not written, neither stored nor failed (a store filter's choice, a
    #: read-through row reused); empty: every block was offered to the backend.
    unwritten: list[bytes] | tuple[()] = ()
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
    #: vLLM's records, built on the finishing I/O thread (:meth:`Job.summarise
    #: <kvstore_tiers.job.Job.summarise>`).
    result: JobResult | None = None
    event: OffloadingEvent | None = None
    #: The job's vLLM id and submit time (monotonic), for the ledger.
    job_id: int = -1
    submit_time: float = 0.0

    @classmethod
    def of(cls, keys: list[bytes], outcomes: list[Any], stored_bytes: list[int],
           is_load: bool, unwritten: list[bytes] | tuple[()] = ()) -> Summary:
        """Condense slot ``s``'s block ``keys[s]``, its outcome (``None`` loaded,
        ``True``/``False`` stored/existed, :data:`NOT_WRITTEN`, or the error) and
        frame bytes moved; ``unwritten``: a store's blocks not offered to the backend."""
        n = len(keys)
        # The common case in C (this runs holding the GIL the scheduler wants).
        # ``ok`` is the job's own key list (never mutated): no copy.
        if is_load and outcomes.count(None) == n:
            return cls(keys, [], frame_bytes=sum(stored_bytes))
        if not is_load and outcomes.count(True) == n:
            return cls(keys, [], unwritten, written=n, frame_bytes=sum(stored_bytes))
        s = cls([], [], unwritten, cancelled_keys=[] if is_load else ())
        for key, res, nbytes in zip(keys, outcomes, stored_bytes, strict=True):
            if res is NOT_WRITTEN:
                s.unwritten = [*s.unwritten, key]
                continue
            if not isinstance(res, BaseException):
                s.ok.append(key)
                if res is False and not is_load:
                    s.existed += 1
                else:
                    s.written += not is_load
                    s.frame_bytes += nbytes
                continue
            s.bad.append(key)
            if isinstance(res, Cancelled):
                s.cancelled += 1
                if is_load:
                    s.cancelled_keys.append(key)  # type: ignore[union-attr]
            elif isinstance(res, ObjectMissing):
                s.missing += 1
            elif isinstance(res, ObjectCorrupt):
                s.corrupt += 1
                s.first_corrupt = s.first_corrupt or res
            else:
                s.transient += isinstance(res, TransientError) or is_load
                s.first_error = s.first_error or res
        return s


# -- on the scheduler thread -------------------------------------------------------------
def nothing_stored(job_id: int) -> JobResult:
    """The result of a store job that wrote nothing and failed nothing.

    ``transfer_bytes=0``: vLLM's backpressure detector ignores such a result
    rather than counting it as a store that took no time.
    """
    return JobResult(job_id=job_id, success=True, transfer_time=0.0, transfer_bytes=0)
