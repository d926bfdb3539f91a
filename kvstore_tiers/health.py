"""A per-tier circuit breaker, driven from the scheduler thread.

After ``threshold`` consecutive failed jobs the circuit opens: lookups miss
at once and stores are dropped and counted, so a dead backend costs vLLM
nothing but recomputation. After ``cooldown_s`` one job is let through as a
half-open probe; its success closes the circuit, its failure opens it again.
A job that proves nothing (below) gives the probe back: lookups go on and
the next job, a load or a store, probes.

What counts is decided by keys, not jobs (:meth:`CircuitBreaker.record_keys`):

* a job **succeeds** if the backend answered at least one of its keys
  (stored, already there, loaded, or a definite "missing"/"corrupt"): an
  answer proves the backend serves, even while some of its keys fail;
* a job **fails** only if none of its keys was answered and at least one
  failed with a transient error (timeout, connection, I/O);
* a job whose keys were all cancelled (``drain_jobs``: ``reset_cache``,
  sleep, shutdown) counts neither way: a cancellation is not a backend
  failure. A cancelled half-open probe is given back, so the next job probes.

So a partial outage -- one dead Redis Cluster master of three, a failed
disk under some of a tier's shards -- never opens the circuit while jobs
span live keys: the dead keys cost only themselves (a failed load's key
answers MISS, a failed store's key is forgotten and stored again later).
The circuit opens when ``threshold`` jobs in a row get no answer for any
key: the whole backend is down, or every recent job fell on its dead part.

Only the scheduler thread calls it (lookup, submit, get_finished_jobs), so it
needs no lock.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class BreakerState(enum.IntEnum):
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitBreaker:
    def __init__(
        self, name: str, threshold: int, cooldown_s: float,
        clock: Callable[[], float] = time.monotonic, log: logging.Logger = logger,
    ) -> None:
        self.name = name
        self._log = log  # the tier's SchedulerLogger: it opens and closes on that thread
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self.state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._probe_out = False
        self.times_opened = 0

    def allow(self) -> bool:
        """May a job be sent to the backend now? (Consumes the half-open probe.)"""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN and self._clock() - self._opened_at >= self.cooldown_s:
            self.state = BreakerState.HALF_OPEN
            self._probe_out = False
        if self.state is BreakerState.HALF_OPEN and not self._probe_out:
            self._probe_out = True
            return True
        return False

    @property
    def is_open(self) -> bool:
        """True while lookups should miss without asking the backend: open and
        cooling down, or half-open with its probe out. Half-open with no probe
        out (the last one proved nothing), lookups go on, so that a load can be
        the probe: were they to miss, only a store of a block new to the tier
        could probe, and an engine whose blocks are all there already would
        miss for ever."""
        if self.state is BreakerState.CLOSED:
            return False
        if self.state is BreakerState.OPEN:
            return self._clock() - self._opened_at < self.cooldown_s
        return self._probe_out

    def record_keys(self, answered: int, failed: int) -> None:
        """Record one finished job by its keys (the rule in the module docstring).

        ``answered``: keys the backend answered; ``failed``: keys that failed
        with a transient error. Cancelled keys are in neither.
        """
        if answered:
            self.record(True)
        elif failed:
            self.record(False)
        elif self.state is BreakerState.HALF_OPEN:
            self._probe_out = False  # a cancelled probe proved nothing: probe again

    def record(self, success: bool) -> None:
        if success:
            if self.state is not BreakerState.CLOSED:
                self._log.warning("kvstore tier %s: backend healthy again; circuit closed",
                                  self.name)
            self.state = BreakerState.CLOSED
            self._failures = 0
            return
        self._failures += 1
        if self.state is BreakerState.HALF_OPEN or (
            self.state is BreakerState.CLOSED and self._failures >= self.threshold
        ):
            if self.state is BreakerState.CLOSED:
                self.times_opened += 1
                self._log.warning(
                    "kvstore tier %s: %d consecutive backend failures; circuit open "
                    "(lookups miss, stores are dropped) for %.1fs",
                    self.name, self._failures, self.cooldown_s,
                )
            self.state = BreakerState.OPEN
            self._opened_at = self._clock()
            self._probe_out = False
