"""The fault-matrix scorecard and a driver that plays vLLM's scheduler around faults.

Every test of this package drives vLLM's real ``TieringOffloadingManager``
through :class:`Driver`, which wraps each call the scheduler would make and
counts, per backend:

* ``faults`` -- faults injected (each armed fault, each tampered object, ...);
* ``wrong_bytes`` -- loaded rows that differ from what was stored (must be 0:
  every loaded row is compared byte-exact with the bytes stored under its key);
* ``exceptions`` -- exceptions that escaped a manager call, i.e. would have
  reached vLLM's scheduler (must be 0);
* ``blocked`` -- scheduler-thread calls slower than ``STEP_BOUND_S`` (must be
  0). A generous correctness bound (no call may wait on I/O), not a speed claim;
  ``reset_cache``, which the contract allows to block, is not timed;
* ``leaks`` -- primary slots still pinned or write-pending once everything
  settled, tier jobs left, or threads left after shutdown (must be 0).

Measured, never asserted: ``max_call``, the slowest manager call (vLLM's
own work and the harness's row copies included), and ``max_tier``, the
slowest call of one of the tier's scheduler-thread methods (every method
vLLM calls on its scheduler thread but ``drain_jobs`` and ``shutdown``, which
may block by contract), each with what its wall time was made of
(:class:`CallClock`): the thread's own CPU time, its wait for a CPU on the
kernel's run queue, the time it slept (the GIL, a lock, I/O), and how much
of the call garbage collection took in any thread.

``tests/faults/conftest.py`` prints the table at the end of the session.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
from vllm.v1.kv_offload.base import LookupResult

from kvstore_tiers.admin.harness import Harness, build_harness, rows_for

HIT, MISS = LookupResult.HIT, LookupResult.MISS
#: A scheduler-thread call slower than this counts as a blocked engine step.
STEP_BOUND_S = 0.050


#: The tier methods vLLM calls on its scheduler thread that must never wait
#: (``drain_jobs`` and ``shutdown`` may block by contract: not timed).
SCHEDULER_METHODS = ("on_new_request", "lookup", "submit_store", "submit_load",
                     "get_finished_jobs", "take_events", "touch", "on_request_finished",
                     "on_schedule_end", "get_stats")


class CallClock:
    """What a call's wall time was made of, for the thread that makes it.

    The kernel has the thread in one of three states: on a CPU (``cpu``, its
    CPU time), waiting on the run queue for one (``runq``,
    ``/proc/thread-self/schedstat``, 0 where absent; read just outside the
    wall-clock window, so it may exceed the wall time by the reads' own
    wait), or asleep, the rest: on the GIL, since the tier's scheduler
    methods take no lock another thread holds and do no I/O. ``gc`` says
    what part of the window collections took, in any thread: in this one
    they are CPU or run-queue time, in another the GIL is held meanwhile.
    """

    gc_s = 0.0  # seconds of garbage collection so far, every thread
    _gc_start: ClassVar[dict[int, float]] = {}
    _fds: ClassVar[dict[int, int]] = {}

    @classmethod
    def on_gc(cls, phase: str, info: dict[str, Any]) -> None:
        tid = threading.get_ident()
        if phase == "start":
            cls._gc_start[tid] = time.perf_counter()
        elif (t0 := cls._gc_start.pop(tid, None)) is not None:
            cls.gc_s += time.perf_counter() - t0

    @classmethod
    def runq_s(cls) -> float:
        """This thread's run-queue wait so far (seconds)."""
        tid = threading.get_ident()
        fd = cls._fds.get(tid)
        try:
            if fd is None:
                fd = cls._fds[tid] = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
            return int(os.pread(fd, 64, 0).split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            return 0.0

    @classmethod
    def now(cls) -> tuple[float, float, float, float]:
        """(wall, cpu, runq, gc) seconds, to subtract from a later reading.

        The wall clock is read last: reading schedstat releases the GIL, and
        taking it back must not count as the call's time.
        """
        runq, gc_s, cpu = cls.runq_s(), cls.gc_s, time.thread_time()
        return time.perf_counter(), cpu, runq, gc_s


gc.callbacks.append(CallClock.on_gc)


@dataclass
class Slowest:
    """The slowest of a kind of call, and what its wall time was made of (:class:`CallClock`)."""

    ms: float = 0.0
    method: str = ""
    cpu_ms: float = 0.0
    runq_ms: float = 0.0
    gc_ms: float = 0.0

    def note(self, method: str, start: tuple[float, float, float, float]) -> float:
        """Account a call that began at ``start`` (:meth:`CallClock.now`); its seconds."""
        took = time.perf_counter() - start[0]
        if took * 1000 > self.ms:
            end = time.perf_counter(), time.thread_time(), CallClock.runq_s(), CallClock.gc_s
            self.ms, self.method = took * 1000, method
            self.cpu_ms, self.runq_ms, self.gc_ms = ((end[i] - start[i]) * 1000
                                                     for i in (1, 2, 3))
        return took

    @property
    def text(self) -> str:
        if not self.method:
            return "-"
        slept = max(0.0, self.ms - self.cpu_ms - self.runq_ms)
        return (f"{self.ms:.1f} ms {self.method}: cpu {self.cpu_ms:.1f}, run queue "
                f"{self.runq_ms:.1f}, slept {slept:.1f}; gc {self.gc_ms:.1f}")


@dataclass
class Score:
    faults: int = 0
    wrong_bytes: int = 0
    exceptions: int = 0
    blocked: int = 0
    leaks: int = 0
    rows_verified: int = 0
    calls: int = 0
    #: The slowest manager call (vLLM's work and the harness's included).
    max_call: Slowest = field(default_factory=Slowest)
    #: The slowest call of one of the tier's own scheduler-thread methods.
    max_tier: Slowest = field(default_factory=Slowest)
    kinds: Counter[str] = field(default_factory=Counter)

    def fault(self, kind: str, n: int = 1) -> None:
        self.faults += n
        self.kinds[kind] += n


SCORES: dict[str, Score] = {}


def score(backend: str) -> Score:
    return SCORES.setdefault(backend, Score())


def _tier_threads() -> set[int]:
    """Threads that a tier could own (test infrastructure threads excluded)."""
    skip = ("faultproxy", "process_request_thread", "tcpproxy", "fakeresp")
    return {t.ident or 0 for t in threading.enumerate() if not any(s in t.name for s in skip)}


class Driver:
    """One harness (vLLM spec + manager + our tier) driven like the scheduler, with scoring.

    Several Drivers may be alive at once (two tenants, two engines). Threads
    are then counted for the group: the threads that existed before the first
    of them was made, checked when the last of them closes -- a tier's threads
    may start lazily (e.g. a resolver thread at the first request), so no
    single Driver can tell its own from a sibling's.
    """

    _live: ClassVar[set[int]] = set()
    _group_before: ClassVar[set[int]] = set()

    def __init__(self, backend: str, tiers: Sequence[dict[str, Any]], *, num_chunks: int = 16,
                 chunk_bytes: int = 16384, **kw: Any) -> None:
        self.score = score(backend)
        if not Driver._live:
            Driver._group_before = _tier_threads()
        Driver._live.add(id(self))
        self.h: Harness = build_harness(tiers, num_chunks=num_chunks, chunk_bytes=chunk_bytes,
                                        **kw)
        for tier in self.h.tiers:
            _time_tier_calls(tier, self.score)
        self.row_bytes = chunk_bytes
        self.expected: dict[bytes, bytes] = {}
        self._closed = False

    @property
    def tier(self) -> Any:
        return self.h.tiers[0]

    # -- timed, guarded scheduler calls ----------------------------------------------
    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        s = self.score
        start = CallClock.now()
        try:
            return fn(*args)
        except Exception:
            s.exceptions += 1
            import traceback

            traceback.print_exc()
            return None
        finally:
            took = s.max_call.note(getattr(fn, "__name__", "call"), start)
            s.calls += 1
            if took > STEP_BOUND_S:
                s.blocked += 1

    def _lookup_all(self, keys: Sequence[bytes], ctx: Any) -> list[Any]:
        with self.h.locked():
            return [self.h.manager.lookup(k, ctx) for k in keys]

    def _pending(self) -> bool:
        with self.h.locked():
            return bool(self.h.manager.has_pending_work())

    def _take_events(self) -> None:
        # The engine's connector drains KV events every step; so must we, or
        # vLLM's own event list grows (not a tier leak).
        with self.h.locked():
            list(self.h.manager.take_events())

    def settle(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            self.call(self.h.step)
            self.call(self._take_events)
            if not self.call(self._pending):
                return
            if time.monotonic() > deadline:
                self.score.leaks += 1  # work that never completes is a leak
                return
            time.sleep(0.002)

    # -- what an engine does -------------------------------------------------------------
    def store(self, keys: Sequence[bytes], rows: np.ndarray, *, expect: bool = True) -> None:
        """A request computes ``rows`` for ``keys``; they cascade to the tier."""
        if expect:
            for k, r in zip(keys, rows, strict=True):
                self.expected[k] = r.tobytes()
        ctx = self.call(self.h.new_request)
        self.call(self.h.store, list(keys), rows, ctx)
        self.settle()
        self.call(self.h.finish_request, ctx)

    def forget_primary(self) -> None:
        """reset_cache (may block by contract: drain_jobs) -- not timed against the bound."""
        try:
            self.h.forget_primary()
        except Exception:
            self.score.exceptions += 1
            raise

    def fetch(self, keys: Sequence[bytes], max_wait_s: float = 20.0,
              after_first_lookup: Callable[[], None] | None = None) -> list[Any]:
        """A new request looks ``keys`` up until resolved, loads its HITs, checks the bytes.

        Returns the final lookup results. Every loaded row is compared with the
        bytes stored under its key (``wrong_bytes`` otherwise).
        ``after_first_lookup`` runs between the first lookups (promotions
        queued) and the step that submits the loads.
        """
        ctx = self.call(self.h.new_request)
        deadline = time.monotonic() + max_wait_s
        first = True
        while True:
            results = self.call(self._lookup_all, keys, ctx) or [MISS] * len(keys)
            if first and after_first_lookup is not None:
                after_first_lookup()
            first = False
            if all(r in (HIT, MISS) for r in results):
                break
            if time.monotonic() > deadline:
                self.score.leaks += 1  # a request stuck in RETRY forever
                break
            self.call(self.h.step)
            time.sleep(0.002)
        hits = [k for k, r in zip(keys, results, strict=True) if r == HIT]
        if hits:
            rows = self.call(self.h.load, hits, ctx)
            if rows is not None:
                for k, row in zip(hits, rows, strict=True):
                    self.score.rows_verified += 1
                    if row.tobytes() != self.expected.get(k):
                        self.score.wrong_bytes += 1
        self.settle()
        self.call(self.h.finish_request, ctx)
        return list(results)

    def reuse_expired_rows(self, seed: int, release: Callable[[], None]) -> list[bytes]:
        """After a load job failed at its deadline with I/O threads still stuck in the
        backend: 4 other blocks take the rows it freed, then ``release`` lets the stuck
        threads return, and once every I/O job is over the new blocks must still be
        byte-exact in the primary (the late threads discarded what they read).
        Returns the 4 new keys.
        """
        from kvstore_tiers.admin.harness import make_keys

        others = make_keys(4, seed=seed)
        other_rows = rows_for(others, self.row_bytes)
        for k, r in zip(others, other_rows, strict=True):
            self.expected[k] = r.tobytes()
        ctx = self.call(self.h.new_request)
        self.call(self.h.store, others, other_rows, ctx)
        release()
        self.tier.pool.wait_idle()  # the stuck threads are done, late writes included
        self.settle()
        self.call(self.h.finish_request, ctx)
        assert self.fetch(others) == [HIT] * 4  # from the primary, byte-exact
        return others

    # -- leak accounting -----------------------------------------------------------------
    def check_settled(self) -> int:
        """Count pinned/write-pending primary slots and jobs left; add them to ``leaks``."""
        self.settle()
        m = self.h.manager
        p = m.primary_tier
        leaked = len(m._jobs)  # every tier job is one of the manager's until reported
        reclaimable = p._get_num_free_chunks() + p._num_evictable_cache_chunks
        leaked += p._num_chunks - reclaimable
        self.score.leaks += leaked
        return leaked

    def close(self) -> int:
        """Check slots, shut down, then count threads left behind (added to ``leaks``)."""
        if self._closed:
            return 0
        self._closed = True
        leaked = self.check_settled()
        self.h.shutdown()
        Driver._live.discard(id(self))
        if Driver._live:
            return leaked  # threads are checked when the group's last Driver closes
        deadline = time.monotonic() + 5
        extra: set[int] = set()
        while time.monotonic() < deadline:
            extra = _tier_threads() - Driver._group_before
            if not extra:
                break
            time.sleep(0.02)
        self.score.leaks += len(extra)
        if extra:  # name them: a leak report is only useful with the culprits
            names = sorted(t.name for t in threading.enumerate() if t.ident in extra)
            print(f"kvstore fault driver: threads left behind: {names}")
        return leaked + len(extra)


def _time_tier_calls(tier: Any, s: Score) -> None:
    """Time every scheduler-thread method of ``tier`` vLLM's manager calls (on the
    instance: the manager looks them up there), into ``s``."""
    def timed(method: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kw: Any) -> Any:
            start = CallClock.now()
            try:
                return fn(*args, **kw)
            finally:
                s.max_tier.note(method, start)
        return call

    for name in SCHEDULER_METHODS:
        setattr(tier, name, timed(name, getattr(tier, name)))


# -- object tampering through the backend's own byte API --------------------------------------
def _rewrite(tier: Any, key: bytes, mutate: Callable[[bytes], bytes]) -> None:
    be, name = tier.backend, tier.namespace.object_name(key)
    data = bytes(be.get(name))
    be.delete(name)
    be.put(name, [mutate(data)])


def corrupt(tier: Any, key: bytes) -> None:
    """Flip one payload byte (the header still parses)."""
    def flip(d: bytes) -> bytes:
        b = bytearray(d)
        b[-7] ^= 0x5A
        return bytes(b)
    _rewrite(tier, key, flip)


def truncate(tier: Any, key: bytes) -> None:
    _rewrite(tier, key, lambda d: d[: len(d) // 2])


def foreign_namespace(tier: Any, key: bytes) -> None:
    """Rewrite the frame's namespace digest: the object now belongs to another namespace."""
    def swap(d: bytes) -> bytes:
        b = bytearray(d)
        b[40:56] = bytes(x ^ 0xFF for x in b[40:56])
        return bytes(b)
    _rewrite(tier, key, swap)


def foreign_key(tier: Any, key: bytes, other: bytes) -> None:
    """Put ``other``'s (valid) frame under ``key``'s name."""
    be = tier.backend
    data = bytes(be.get(tier.namespace.object_name(other)))
    _rewrite(tier, key, lambda _d: data)


def expire(tier: Any, key: bytes) -> None:
    tier.backend.delete(tier.namespace.object_name(key))


def run_tamper_matrix(d: Driver, seed: int) -> None:
    """Corrupted, truncated, foreign-namespace, foreign-key and expiring objects.

    Each is a MISS (never wrong bytes) for the request that meets it; the
    other blocks of the same request still load.
    """
    from kvstore_tiers.admin.harness import make_keys

    keys = make_keys(10, seed=seed)
    d.store(keys, rows_for(keys, d.row_bytes))
    d.forget_primary()
    tier = d.tier
    corrupt(tier, keys[0])
    truncate(tier, keys[1])
    foreign_namespace(tier, keys[2])
    foreign_key(tier, keys[3], keys[9])
    for kind in ("corrupted", "truncated", "foreign_namespace", "foreign_key"):
        d.score.fault(kind)
    res = d.fetch(keys)
    assert res[:4] == [MISS] * 4, res
    assert res[4:] == [HIT] * 6, res

    # Expiry between lookup and load: the tier answers HIT (promotion queued),
    # then the objects go away before the load runs.
    more = make_keys(4, seed=seed + 1)
    d.store(more, rows_for(more, d.row_bytes))
    d.forget_primary()

    def vanish() -> None:
        for k in more[:2]:
            expire(tier, k)
        d.score.fault("expired_between_lookup_and_load", 2)

    res = d.fetch(more, after_first_lookup=vanish)
    assert res == [MISS, MISS, HIT, HIT], res
