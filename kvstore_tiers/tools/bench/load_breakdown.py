"""Where a load's time goes: the load trace summarised, and a small fs run that writes one.

A trace file holds one JSON line per load job (:mod:`kvstore_tiers.loadtrace`
writes ours when ``KVSTORE_TIERS_LOAD_TRACE`` names the file). Per job,
milliseconds:

* **queue wait**: vLLM's submit until an I/O thread took the first batch;
* **transfer**: first batch taken until the last batch done (wall clock);
* **read**: the reads, summed over the job's batches (thread time; fs: its
  one GIL-free read per batch, which checksums the rows too; a backend
  that marks nothing: its whole batch call);
* **verify/decode**: the frames finished after the read (header and
  checksum verdict, decode), summed over batches; "-" where the backend
  marks nothing;
* **publish wait**: last batch done until the job was in the pool's
  ``finished`` deque;
* **pick-up wait**: until ``get_finished_jobs`` returned it;
* **total**: vLLM's submit until ``get_finished_jobs`` returned it.

vLLM's stock fs tier cannot be traced inside; :func:`run` observes it from
outside (its ``submit_load`` and ``get_finished_jobs`` wrapped here, in the
bench only) and writes lines with ``submit`` and ``picked`` alone: its
**total** is the same two endpoints as ours.

:func:`run` is ``kvstore-tiers bench --load-trace``: our fs tier and vLLM's,
alternating, store a window and a fresh manager loads it back one request
(one job) at a time, ours traced.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvstore_tiers.loadtrace import LOAD_TRACE_ENV

#: (key, label) of each phase, in the order of a load.
PHASES = (("queue", "queue wait"), ("transfer", "transfer (wall)"),
          ("read", "read (summed over batches)"), ("verify", "verify/decode (summed)"),
          ("publish", "publish wait"),
          ("pickup", "pick-up wait"), ("total", "total: submit to pick-up"))


def read_trace(path: Path) -> list[dict[str, Any]]:
    """The records of a trace file (blank lines skipped); ValueError naming the
    line that is not a JSON object."""
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{path}:{n}: not JSON ({exc})") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{path}:{n}: not a JSON object")
        out.append(rec)
    return out


def _span(a: float | None, b: float | None) -> float | None:
    return (b - a) * 1e3 if a is not None and b is not None else None


def _marks(batch: dict[str, Any]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for stage, t in batch.get("marks") or ():
        out.setdefault(stage, []).append(t)
    return out


def job_phases(rec: dict[str, Any]) -> dict[str, float | None]:
    """One record's phases in milliseconds (module doc), None where it has no data."""
    batches = rec.get("batches") or []
    first = min((b["start"] for b in batches), default=None)
    last = max((b["end"] for b in batches), default=None)
    read: float | None = None
    verify: float | None = None
    if batches:
        read, verify = 0.0, 0.0
        for b in batches:
            m = _marks(b)
            if "read" in m and "read_end" in m:
                read_end = m["read_end"][-1]
                read += (read_end - m["read"][0]) * 1e3
                if verify is not None:
                    verify += (max(m.get("frame") or [read_end]) - read_end) * 1e3
            else:  # the backend marks nothing: its whole batch call is the read
                read += (b["call_end"] - b["call"]) * 1e3
                verify = None
    return {"queue": _span(rec.get("submit"), first), "transfer": _span(first, last),
            "read": read, "verify": verify, "publish": _span(last, rec.get("published")),
            "pickup": _span(rec.get("published"), rec.get("picked")),
            "total": _span(rec.get("submit"), rec.get("picked"))}


def summarise(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per tier (the records' ``tier``): ``jobs``, ``chunks`` (median per job) and
    per phase ``{"jobs", "median_ms", "p90_ms"}`` over the jobs that have it."""
    by_tier: dict[str, list[dict[str, Any]]] = {}
    for rec in records:
        by_tier.setdefault(str(rec.get("tier")), []).append(rec)
    out: dict[str, dict[str, Any]] = {}
    for tier, recs in by_tier.items():
        phases = [job_phases(r) for r in recs]
        chunks = [r["chunks"] for r in recs if r.get("chunks")]
        row: dict[str, Any] = {"jobs": len(recs),
                               "chunks": float(np.median(chunks)) if chunks else None}
        for key, _label in PHASES:
            xs = [p[key] for p in phases if p[key] is not None]
            row[key] = ({"jobs": len(xs), "median_ms": float(np.median(xs)),
                         "p90_ms": float(np.percentile(xs, 90))} if xs else None)
        out[tier] = row
    return out


def table(summary: dict[str, dict[str, Any]], title: str = "load trace") -> Any:
    """A rich table: one row per phase, median and p90 per tier."""
    from rich.table import Table

    jobs = ", ".join(f"{tier}: {s['jobs']} jobs" + (f" of {s['chunks']:g} chunks"
                                                     if s.get("chunks") else "")
                     for tier, s in summary.items())
    t = Table(title=f"{title}: ms per load job, median / p90 ({jobs})")
    t.add_column("phase")
    for tier in summary:
        t.add_column(f"{tier} median", justify="right")
        t.add_column(f"{tier} p90", justify="right")
    for key, label in PHASES:
        cells = []
        for s in summary.values():
            p = s.get(key)
            cells += [f"{p['median_ms']:.2f}", f"{p['p90_ms']:.2f}"] if p else ["-", "-"]
        t.add_row(label, *cells)
    return t


# -- the run --------------------------------------------------------------------------
@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


class StockObserver:
    """vLLM's stock tier seen from outside: its ``submit_load`` and
    ``get_finished_jobs`` wrapped, each load's vLLM submit time and the time
    ``get_finished_jobs`` returned it, as trace lines of ``tier``."""

    def __init__(self, tier: str) -> None:
        self.tier = tier
        self.jobs: dict[int, dict[str, Any]] = {}

    def attach(self, h: Any) -> None:
        tier = h.tiers[0]
        submit_load, finished = tier.submit_load, tier.get_finished_jobs

        def observed_submit(job: Any) -> None:
            self.jobs[job.job_id] = {"pid": os.getpid(), "tier": self.tier, "job": job.job_id,
                                     "chunks": len(job.keys), "submit": job.submit_time,
                                     "picked": None, "observed": "outside"}
            submit_load(job)

        def observed_finished() -> Any:
            out = list(finished())
            now = time.monotonic()
            for r in out:
                rec = self.jobs.get(r.job_id)
                if rec is not None and rec["picked"] is None:
                    rec.update(picked=now, ok=r.success)
            return out

        tier.submit_load, tier.get_finished_jobs = observed_submit, observed_finished

    def write(self, path: Path) -> None:
        with path.open("a") as f:
            for rec in self.jobs.values():
                f.write(json.dumps(rec) + "\n")
        self.jobs.clear()


#: Chunks per load job of :func:`run` (one request's prefix).
JOB_CHUNKS = 16


def load_jobs(kind: str, root: Path, chunk: int, keys: list[bytes],
              observe: Callable[[Any], None] | None = None, busy: bool = False) -> None:
    """A fresh manager (a new engine) loads ``keys`` as one request after
    another, :data:`JOB_CHUNKS` keys each, each promoted as vLLM's scheduler
    does (:func:`~kvstore_tiers.tools.bench.fs_bench.promote_all`: a step
    every ~0.2 ms, which bounds the pick-up wait measured here; ``busy``:
    the loop holds the GIL between steps, as an engine's does);
    ``observe(harness)`` first."""
    from kvstore_tiers.tools.bench import fs_bench

    h = fs_bench.build_harness([fs_bench._tier_cfg(kind, root)], num_chunks=len(keys),
                               chunk_bytes=chunk)
    try:
        if observe is not None:
            observe(h)
        for s in range(0, len(keys), JOB_CHUNKS):
            ctx = h.new_request()
            fs_bench.promote_all(h, [(ctx, keys[s:s + JOB_CHUNKS])],
                                 fs_bench.spin if busy else time.sleep)
            h.finish_request(ctx)
    finally:
        h.shutdown()


def run(directory: Path, chunk: int, total_bytes: int, rounds: int, trace_path: Path,
        progress: Callable[[str], None] = print, busy: bool = False) -> dict[str, Any]:
    """``rounds`` alternating rounds of ours and vLLM's stock fs tier: each stores
    ``total_bytes``, at least one job's worth (``fs_bench.store_round``), then
    :func:`load_jobs` loads them, ours with the load trace on, the stock
    tier observed from outside; every line goes to ``trace_path`` (emptied
    first). Returns ``{"chunk_bytes", "job_chunks", "jobs_per_round", "rounds",
    "summary"}``."""
    from kvstore_tiers.plugin import register
    from kvstore_tiers.tools.bench import fs_bench

    register()
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    trace_path.write_text("")
    n = max(JOB_CHUNKS, total_bytes // chunk // JOB_CHUNKS * JOB_CHUNKS)
    for r in range(rounds):
        for kind in (fs_bench.TIERS if r % 2 == 0 else reversed(list(fs_bench.TIERS))):
            root = Path(tempfile.mkdtemp(prefix=f"bench-trace-{kind}-", dir=directory))
            try:
                keys = fs_bench.store_round(kind, root, chunk, n, 1, seed=r)[1]
                os.sync()
                if kind == "kvstore":
                    with _env(LOAD_TRACE_ENV, str(trace_path)):  # written at its shutdown
                        load_jobs(kind, root, chunk, keys, busy=busy)
                else:
                    stock = StockObserver(fs_bench.TIERS[kind])
                    load_jobs(kind, root, chunk, keys, stock.attach, busy)
                    stock.write(trace_path)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            progress(f"load trace: round {r + 1} of {rounds}, {kind}")
    return {"chunk_bytes": chunk, "job_chunks": JOB_CHUNKS, "jobs_per_round": n // JOB_CHUNKS,
            "rounds": rounds, "busy_scheduler": busy, "summary": summarise(read_trace(trace_path))}
