"""One host of a fleet test: vLLM's real TieringOffloadingManager over a shared
tier, serving requests in a loop the way an engine's scheduler would; one
such engine per shared server, each on its own thread (one process start-up,
vLLM's imports, for all of them: the slow part on a small machine).

Run inside the host's network namespace as ``python -m tests.fleet.host SPEC``
(``SPEC``: JSON, :class:`HostSpec`'s fields). Each engine stores the fleet's
prompts (write-once: the first host writes them, the others find them
there) and serves each once (its connections are open, its first loads
done); then the host prints ``{"event": "ready"}``, waits for ``go`` on
stdin, serves the prompts in turn until ``stop``, and prints one
``{"event": "report"}`` line: per engine, a record per request and every
change of its tier's breaker state, times on ``time.monotonic()`` (one clock
for every process of the machine, whatever its namespace).

A request looks its blocks up every step until each is HIT or MISS; its hits
are loaded and compared byte for byte with the rows stored under their keys;
its misses are recomputed: their rows are stored, which cascades to the
tier, and the request does not wait for that store (an engine does not).
The primary holds half the prompts' blocks, so its LRU has evicted a
prompt's blocks by the time the prompt comes round again: every hit is
promoted from the shared tier. Each of the tier's scheduler-thread methods
is timed, and a request's record keeps the slowest call made while it ran.
"""

from __future__ import annotations

import gc
import json
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import LookupResult

from kvstore_tiers.admin.harness import Harness, build_harness, make_keys, rows_for
from tests.faults.common import SCHEDULER_METHODS
from tests.fleet.control import wait_for_go

HIT, MISS = LookupResult.HIT, LookupResult.MISS


@dataclass
class HostSpec:
    name: str
    tiers: dict[str, dict[str, Any]]  # one engine per shared server: its name -> tier config
    prompts: int = 12
    blocks_per_prompt: int = 4
    row_bytes: int = 16384
    seed: int = 52
    first_prompt: int = 0  # where in the cycle this host starts
    pace_s: float = 0.02  # idle time between requests


@dataclass
class Request:
    t0: float  # arrival (first lookup)
    t1: float  # every block resolved (HIT or MISS)
    blocks: int
    hits: int  # blocks promoted from the shared tier
    misses: int  # blocks recomputed
    wrong: int  # loaded rows that differ from the bytes stored under their key
    max_tier_ms: float  # slowest scheduler-thread tier call while it ran
    max_tier_method: str


@dataclass
class Report:
    host: str
    server: str
    requests: list[Request] = field(default_factory=list)
    breaker: list[tuple[float, str]] = field(default_factory=list)  # (t, new state)
    counters: dict[str, int] = field(default_factory=dict)
    times_opened: int = 0


class SlowestCall:
    """The slowest call of the tier's scheduler-thread methods since :meth:`reset`."""

    def __init__(self, tier: Any) -> None:
        self.ms, self.method = 0.0, ""
        for name in SCHEDULER_METHODS:
            setattr(tier, name, self._timed(name, getattr(tier, name)))

    def _timed(self, name: str, fn: Any) -> Any:
        def call(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                ms = (time.perf_counter() - t0) * 1000
                if ms > self.ms:
                    self.ms, self.method = ms, name
        return call

    def reset(self) -> tuple[float, str]:
        out = self.ms, self.method
        self.ms, self.method = 0.0, ""
        return out


class Engine:
    """vLLM's manager with one tier, on one shared server, serving like an engine."""

    def __init__(self, spec: HostSpec, server: str) -> None:
        self.spec = spec
        n = spec.prompts * spec.blocks_per_prompt
        self.keys = make_keys(n, seed=spec.seed)
        self.rows = rows_for(self.keys, spec.row_bytes)
        self.want = {k: self.rows[i].tobytes() for i, k in enumerate(self.keys)}
        self.h: Harness = build_harness([spec.tiers[server]], num_chunks=n // 2,
                                        chunk_bytes=spec.row_bytes)
        self.tier = self.h.tiers[0]
        self.slowest = SlowestCall(self.tier)
        self.report = Report(spec.name, server)
        self._state = self.tier.breaker.state.name

    def prompt(self, i: int) -> list[bytes]:
        b = self.spec.blocks_per_prompt
        i %= self.spec.prompts
        return self.keys[i * b:(i + 1) * b]

    def _note_breaker(self) -> None:
        state = self.tier.breaker.state.name
        if state != self._state:
            self.report.breaker.append((time.monotonic(), state))
            self._state = state

    def _step(self) -> None:
        self.h.step()
        with self.h.locked():
            list(self.h.manager.take_events())  # as the connector drains them each step
        self._note_breaker()

    def seed(self) -> None:
        """Store every prompt and wait for the stores (SET NX / If-None-Match: one writer)."""
        for i in range(self.spec.prompts):
            keys = self.prompt(i)
            self.h.store_all(keys, np.stack([np.frombuffer(self.want[k], np.uint8)
                                             for k in keys]))
        self.h.forget_primary()
        for i in range(self.spec.prompts):
            self.serve(i)
        self._state = self.tier.breaker.state.name
        self.report.breaker.clear()
        self.slowest.reset()

    def run(self, first: int, stop: threading.Event) -> None:
        """Serve the prompts in turn, from ``first``, until ``stop``."""
        i = first
        while not stop.is_set():
            self.report.requests.append(self.serve(i))
            i += 1
            time.sleep(self.spec.pace_s)

    def serve(self, i: int) -> Request:
        keys = self.prompt(i)
        loaded_before = self.tier.counters.objects_loaded
        ctx = self.h.new_request()
        t0 = time.monotonic()
        while True:
            with self.h.locked():
                results = [self.h.manager.lookup(k, ctx) for k in keys]
            self._note_breaker()
            if all(r in (HIT, MISS) for r in results):
                break
            self._step()
            time.sleep(0.002)
        t1 = time.monotonic()
        hits = [k for k, r in zip(keys, results, strict=True) if r == HIT]
        wrong = 0
        if hits:
            for k, row in zip(hits, self.h.load(hits, ctx), strict=True):
                wrong += row.tobytes() != self.want[k]
        misses = [k for k, r in zip(keys, results, strict=True) if r == MISS]
        if misses:  # recompute: the engine stores what it computed; the tier gets it
            self._recompute(misses, ctx)
        self._step()
        self.h.finish_request(ctx)
        ms, method = self.slowest.reset()
        loaded = self.tier.counters.objects_loaded - loaded_before
        return Request(t0, t1, len(keys), loaded, len(misses), wrong, ms, method)

    def _recompute(self, keys: list[bytes], ctx: Any) -> None:
        with self.h.locked():
            out = self.h.manager.prepare_store(keys, ctx)
            if out is None:  # the primary has no free row: vLLM would not offload either
                return
            stored = list(out.keys_to_store) if hasattr(out, "keys_to_store") else keys
            for cid, key in zip(np.asarray(out.store_spec.chunk_ids), stored, strict=True):
                self.h.view[int(cid)] = np.frombuffer(self.want[key], np.uint8)
            self.h.manager.complete_store(stored, ctx)

    def finish(self) -> Report:
        self.h.settle(timeout_s=30)
        self.report.counters = self.tier.counters.as_dict()
        self.report.times_opened = self.tier.breaker.times_opened
        self.h.shutdown()
        return self.report


def main() -> None:
    spec = HostSpec(**json.loads(sys.argv[1]))
    engines = [Engine(spec, server) for server in spec.tiers]
    for engine in engines:
        engine.seed()
    # vLLM's import-time heap out of the collector's sight: a full collection over
    # it takes ~0.5 s here and would land inside some timed call (tests/faults too)
    gc.collect()
    gc.freeze()
    print(json.dumps({"event": "ready"}), flush=True)
    stop = wait_for_go()
    threads = [threading.Thread(target=e.run, args=(spec.first_prompt, stop),
                                name=f"engine-{e.report.server}") for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    reports = [asdict(engine.finish()) for engine in engines]
    print(json.dumps({"event": "report", "engines": reports}), flush=True)


if __name__ == "__main__":
    main()
