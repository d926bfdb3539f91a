"""fs tier benchmark: ours against vLLM's stock fs tier, in the same process.

Run by ``kvstore-tiers bench --tier fs`` (:mod:`kvstore_tiers.tools.bench.runner`).
Both tiers are built by vLLM's own factory inside vLLM's real
TieringOffloadingManager (:mod:`kvstore_tiers.admin.harness`), on the same
directory's filesystem, with their default settings, in alternating rounds
(the median is kept, since this machine is noisy). For each chunk size and
for 1 and 4 concurrent requests:

* **store GB/s**: one job per request cascaded primary -> tier, timed from
  ``complete_store`` until every job's result was consumed (after a sync, so
  a fresh root's start-up writes are not in the window);
* **load GB/s**: a *fresh* manager (as a new engine would be) looks the keys
  up step by step like the scheduler, promotes and loads them; timed from the
  first lookup until every key is HIT in the primary;
* **CPU s per GB**, store and load: this process's CPU seconds (user + system,
  every thread: the tier's I/O threads and the driving loop, which makes
  vLLM's manager calls as the scheduler does) over each window, per GB
  (:mod:`kvstore_tiers.tools.bench.cpu`);
* **disk O_DIRECT read/write GB/s**: the machine's own limit, measured in the
  same run on the same directory with the same number of threads as our
  load-priority pool;
* **reload** (``reload_rounds``, off by default): each tier stores one
  window once, then many alternating load-only rounds reread the same files,
  for a ratio with a confidence interval where the disk decides a round;
* **scheduler-thread time** of ``submit_store``, ``submit_load``, ``lookup``
  and ``get_finished_jobs``: p50/p99 microseconds per call and per chunk,
  with about 1,000 chunks in flight.

Incompressible random bytes; our tier with its default ``compression``
(``auto`` = none for fs). :func:`run` returns every number in one dict.
"""

from __future__ import annotations

import functools
import gc
import mmap
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvstore_tiers.admin.harness import Harness, build_harness, make_keys
from kvstore_tiers.backends.fs import O_DIRECT, probe_o_direct
from kvstore_tiers.tools import samples as kv_samples
from kvstore_tiers.tools.bench.cpu import CpuClock
from kvstore_tiers.tools.bench.pairing import (
    balanced_ratio,
    even_rounds,
    ratio_interval,
    round_ratios,
)

KiB, MiB = 1 << 10, 1 << 20
TIERS = {"kvstore": "fs", "vllm": "vllm_fs"}


# ----------------------------------------------------------------- disk limit
def disk_o_direct(directory: Path, chunk: int, total: int, threads: int,
                  o_direct: bool | None = None) -> dict[str, float]:
    """O_DIRECT write then read of ``total`` bytes in ``chunk`` pieces, ``threads`` wide.

    Where the filesystem refuses O_DIRECT (overlayfs, NFS, older tmpfs:
    EINVAL) the probe uses buffered I/O, as our tier then does. ``o_direct``:
    whether it may (None: find out with :func:`probe_o_direct`).
    """
    n = max(threads, total // chunk)
    bufs = [mmap.mmap(-1, chunk) for _ in range(threads)]
    for b in bufs:
        b.write(os.urandom(chunk))
    paths = [directory / f".disk_probe_{i}" for i in range(n)]
    if o_direct is None:
        o_direct = probe_o_direct(str(directory))
    flag = O_DIRECT if o_direct else 0

    def run(fn: Callable[[int, mmap.mmap], None]) -> float:
        t0 = time.perf_counter()
        idx = iter(range(n))
        lock = threading.Lock()

        errors: list[BaseException] = []

        def worker(buf: mmap.mmap) -> None:
            try:
                while True:
                    with lock:
                        i = next(idx, None)
                    if i is None:
                        return
                    fn(i, buf)
            except BaseException as exc:  # a thread's error must fail the probe, not vanish
                errors.append(exc)

        ts = [threading.Thread(target=worker, args=(b,)) for b in bufs]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        if errors:
            raise errors[0]
        return n * chunk / (time.perf_counter() - t0) / 1e9

    def write(i: int, buf: mmap.mmap) -> None:
        fd = os.open(paths[i], os.O_CREAT | os.O_WRONLY | os.O_TRUNC | flag, 0o644)
        try:
            os.write(fd, buf)
        finally:
            os.close(fd)

    def read(i: int, buf: mmap.mmap) -> None:
        fd = os.open(paths[i], os.O_RDONLY | flag)
        try:
            os.readv(fd, [buf])
        finally:
            os.close(fd)

    try:
        return {"write_gbps": run(write), "read_gbps": run(read)}
    finally:
        for p in paths:
            p.unlink(missing_ok=True)
        for b in bufs:
            b.close()


# ------------------------------------------------------------ tier throughput
#: Each throughput window moves at least this many chunks (up to MAX_WINDOW_BYTES):
#: a 64 MiB window of 2 MiB chunks lasted ~60 ms here, and its ratio swung 0.7-1.2x.
MIN_WINDOW_CHUNKS = 256
MAX_WINDOW_BYTES = 1 << 30


def window_chunks(chunk: int, total_bytes: int) -> int:
    """Chunks per throughput window: ``total_bytes`` worth, at least
    MIN_WINDOW_CHUNKS (capped at MAX_WINDOW_BYTES), a multiple of 4 requests."""
    n = max(16, total_bytes // chunk, min(MIN_WINDOW_CHUNKS, MAX_WINDOW_BYTES // chunk))
    return n - n % 4


def _tier_cfg(kind: str, root: Path, **extra: Any) -> dict[str, Any]:
    cfg = {"type": TIERS[kind], "root_dir": str(root), **extra}
    if kind == "kvstore":
        # A throughput round cascades a whole primary's worth at once; every
        # chunk must be written, as vLLM's tier (no such bound) writes them.
        cfg.setdefault("max_store_bytes_in_flight", 0)
    return cfg


def _settle(h: Harness) -> None:
    h.settle(timeout_s=600)


def store_round(kind: str, root: Path, chunk: int, n: int, n_req: int, seed: int
                ) -> tuple[float, list[bytes], float, float]:
    """(GB/s, keys, process CPU s per GB, the same less the driving (scheduler)
    thread) of cascading ``n`` chunks (split over ``n_req`` requests) to the tier."""
    h = build_harness([_tier_cfg(kind, root)], num_chunks=n, chunk_bytes=chunk)
    try:
        keys = make_keys(n, seed=seed)
        rows = np.random.default_rng(seed).integers(0, 256, (n, chunk), dtype=np.uint8)
        per = n // n_req
        groups = [list(range(r * per, (r + 1) * per)) for r in range(n_req)]
        ctxs = [h.new_request() for _ in groups]
        with h.locked():
            outs = [h.manager.prepare_store([keys[i] for i in g], c) for g, c in zip(
                groups, ctxs, strict=True)]
            for g, out in zip(groups, outs, strict=True):
                for cid, i in zip(np.asarray(out.store_spec.chunk_ids), g, strict=True):
                    h.view[int(cid)] = rows[i]
        # A fresh root's start-up writes are no store's window: our tier makes
        # its 4,096 shard directories once, at the first start on a root_dir,
        # and their write-back, landing in the window, halved our x4 stores
        # on the build VM's disk. vLLM's tier makes
        # its directories per block, inside the window, as it does in an engine.
        os.sync()
        t0, cpu = time.perf_counter(), CpuClock()
        with h.locked():
            for g, c in zip(groups, ctxs, strict=True):
                h.manager.complete_store([keys[i] for i in g], c)
        _settle(h)
        dt, (cpu_per_gb, io_cpu_per_gb) = time.perf_counter() - t0, cpu.split_per_gb(n * chunk)
        for c in ctxs:
            h.finish_request(c)
        return n * chunk / dt / 1e9, keys, cpu_per_gb, io_cpu_per_gb
    finally:
        h.shutdown()


def load_round(kind: str, root: Path, chunk: int, keys: list[bytes], n_req: int
               ) -> tuple[float, int, int, float, float]:
    """(GB/s, scheduler steps from first lookup to all HIT, steps until no
    RETRY, process CPU s per GB, the same less the driving (scheduler) thread)
    of a fresh engine promoting ``keys`` (split over ``n_req`` requests)."""
    n = len(keys)
    h = build_harness([_tier_cfg(kind, root)], num_chunks=n, chunk_bytes=chunk)
    try:
        per = n // n_req
        reqs = [(h.new_request(), keys[r * per:(r + 1) * per]) for r in range(n_req)]
        t0, cpu = time.perf_counter(), CpuClock()
        _lookup_steps, steps = promote_all(h, reqs)
        dt, (cpu_per_gb, io_cpu_per_gb) = time.perf_counter() - t0, cpu.split_per_gb(n * chunk)
        for ctx, _ks in reqs:
            h.finish_request(ctx)
        return n * chunk / dt / 1e9, steps, _lookup_steps, cpu_per_gb, io_cpu_per_gb
    finally:
        h.shutdown()


def throughput_row(directory: Path, chunk: int, n: int, n_req: int, rounds: int,
                   disk: dict[str, float]) -> dict[str, Any]:
    """One throughput cell: ``rounds`` alternating rounds of both tiers storing
    ``n`` chunks over ``n_req`` requests then loading them in a fresh manager;
    medians of GB/s, CPU s per GB and steps, paired ratios, and the share of
    ``disk``'s (the same run's O_DIRECT figures) read and write."""
    per: dict[str, dict[str, list[float]]] = {
        k: {"store": [], "load": [], "steps": [], "lookup_steps": [], "store_cpu": [],
            "load_cpu": [], "store_io_cpu": [], "load_io_cpu": []} for k in TIERS}
    for r in range(rounds):
        for kind in (TIERS if r % 2 == 0 else reversed(list(TIERS))):
            root = Path(tempfile.mkdtemp(prefix=f"bench-{kind}-", dir=directory))
            try:
                gbps, keys, cpu, io_cpu = store_round(kind, root, chunk, n, n_req, seed=r)
                per[kind]["store"].append(gbps)
                per[kind]["store_cpu"].append(cpu)
                per[kind]["store_io_cpu"].append(io_cpu)
                # Let the store's write-back finish before the load
                # window opens, whichever tier just wrote.
                os.sync()
                gbps, steps, lsteps, cpu, io_cpu = load_round(kind, root, chunk, keys, n_req)
                per[kind]["load"].append(gbps)
                per[kind]["load_cpu"].append(cpu)
                per[kind]["load_io_cpu"].append(io_cpu)
                per[kind]["steps"].append(steps)
                per[kind]["lookup_steps"].append(lsteps)
            finally:
                shutil.rmtree(root, ignore_errors=True)
                os.sync()  # the deletes' write-back is no tier's window
    row: dict[str, Any] = {"chunk_bytes": chunk, "requests": n_req, "chunks": n}
    for kind in TIERS:
        for op in ("store", "load"):
            row[f"{kind}_{op}_gbps"] = statistics.median(per[kind][op])
            row[f"{kind}_{op}_cpu_s_per_gb"] = statistics.median(per[kind][f"{op}_cpu"])
            row[f"{kind}_{op}_io_cpu_s_per_gb"] = statistics.median(per[kind][f"{op}_io_cpu"])
        row[f"{kind}_steps_to_hit"] = int(statistics.median(per[kind]["steps"]))
        row[f"{kind}_lookup_steps"] = int(statistics.median(per[kind]["lookup_steps"]))
    for op in ("store", "load"):
        # Paired and balanced for position (kvstore_tiers.tools.bench.pairing).
        row[f"{op}_ratio"] = balanced_ratio(per["kvstore"][op], per["vllm"][op])
        row[f"{op}_ratios"] = round_ratios(per["kvstore"][op], per["vllm"][op])
    row["load_vs_disk_read"] = row["kvstore_load_gbps"] / disk["read_gbps"]
    row["store_vs_disk_write"] = row["kvstore_store_gbps"] / disk["write_gbps"]
    return row


def reload_rounds(directory: Path, chunk: int, n: int, n_req: int, rounds: int
                  ) -> dict[str, Any]:
    """Load-only paired rounds: each tier stores ``n`` chunks once, then ``rounds``
    (made even) alternating :func:`load_round` s reread those same files.

    A throughput round also writes, deletes and syncs, and this VM's disk
    then swings a round's ratio 0.3-2.3x; rereading the same files takes the
    writes' aftermath out, and enough rounds give the ratio a confidence
    interval (:func:`~kvstore_tiers.tools.bench.pairing.ratio_interval`).
    """
    rounds = max(2, even_rounds(rounds))
    roots = {k: Path(tempfile.mkdtemp(prefix=f"bench-reload-{k}-", dir=directory))
             for k in TIERS}
    try:
        keys = {k: store_round(k, roots[k], chunk, n, n_req, seed=7)[1] for k in TIERS}
        os.sync()
        gbps: dict[str, list[float]] = {k: [] for k in TIERS}
        for r in range(rounds):
            for kind in (TIERS if r % 2 == 0 else reversed(list(TIERS))):
                gbps[kind].append(load_round(kind, roots[kind], chunk, keys[kind], n_req)[0])
    finally:
        for root in roots.values():
            shutil.rmtree(root, ignore_errors=True)
    ratio, low, high = ratio_interval(gbps["kvstore"], gbps["vllm"])
    return {"chunk_bytes": chunk, "requests": n_req, "chunks": n, "rounds": rounds,
            **{f"{k}_load_gbps": statistics.median(v) for k, v in gbps.items()},
            "load_ratio": ratio, "load_ratio_ci95": [low, high],
            "load_ratios": round_ratios(gbps["kvstore"], gbps["vllm"])}


def spin(seconds: float) -> None:
    """Wait ``seconds`` running Python, holding the GIL as an engine's busy
    scheduler loop does between its steps (``time.sleep`` gives it up)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def promote_all(h: Harness, reqs: list[tuple[Any, list[bytes]]],
                pause: Callable[[float], None] = time.sleep) -> tuple[int, int]:
    """Scheduler-like loop: look every request's keys up each step until none
    is RETRY (all promotions queued), step until the transfers are consumed,
    then check every key is a HIT in the primary. Returns (steps until no
    lookup answered RETRY, steps from the first lookup until every key was
    HIT); steps here are a busy loop 0.2 ms apart, far closer than an engine's,
    with ``pause`` between them (:func:`spin`: the GIL held, as in an engine)."""
    from vllm.v1.kv_offload.base import LookupResult

    start = h.steps
    for _ in range(100_000):
        with h.locked():
            # Every key, every step, as vLLM's scheduler scans a request's
            # prefix (offloading/scheduler.py, _maximal_prefix_lookup): it
            # goes on past a RETRY "to let the manager kick off async
            # lookups", so one step starts them all and the promotions the
            # next step initiates form one job per request. Stopping at the
            # first RETRY would start one lookup per step and make every
            # promotion a one-chunk job.
            results = [h.manager.lookup(k, ctx) for ctx, ks in reqs for k in ks]
        waiting = LookupResult.RETRY in results
        h.step()
        if not waiting:
            break
        pause(0.0002)
    lookup_steps = h.steps - start
    for _ in range(1_000_000):
        with h.locked():
            pending = h.manager.has_pending_work()
        if not pending:
            break
        pause(0.0002)
        h.step()
    with h.locked():
        missing = sum(h.manager.lookup(k, ctx) is not LookupResult.HIT
                      for ctx, ks in reqs for k in ks)
    if missing:
        raise RuntimeError(f"{missing} keys were not loaded")
    return lookup_steps, h.steps - start + 1  # +1: the final lookup that answered HIT


# --------------------------------------------------------- scheduler-thread time
def scheduler_cost(kind: str, root: Path, chunk: int, job_chunks: int, in_flight: int,
                   waves: int = 16, gc_phase_seed: int | None = None,
                   tier_extra: dict[str, Any] | None = None,
                   before_wave: Callable[[Any, list[bytes]], None] | None = None,
                   promote: bool = True,
                   ) -> dict[str, dict[str, float]]:
    """p50/p99 microseconds of the tier methods vLLM calls, per call and per chunk.

    ``waves`` rounds of: queue ``in_flight`` chunks of stores at once (jobs of
    ``job_chunks``), let them finish, forget the primary, promote them all
    back. Several waves, because a p99 over one wave's 64 store jobs is
    nothing but its maximum.

    ``gc_phase_seed``: every wave repeats the same allocations, and forgetting
    the primary frees enough to bring CPython's gen-0 counter to the same
    value before each wave, so a cyclic-GC pass starts at the same point of
    every wave and lands in the same call, 16 times or never: a lottery on
    which method's allocation is 700th. In an engine, whose steps allocate
    varying amounts, that point falls anywhere. With a seed, each wave
    starts with a random number (0 to the threshold) of extra young objects,
    held until the wave ends, so the pass falls anywhere too and each
    method takes its share of passes by its share of allocations.

    ``tier_extra``: more keys of the tier's config (the admission A/B);
    ``before_wave(tier, keys)`` runs, untimed, before each wave's stores;
    ``promote=False`` leaves the promotions out (stores only).
    """
    h = build_harness([_tier_cfg(kind, root, **(tier_extra or {}))],
                      num_chunks=in_flight * 2, chunk_bytes=chunk)
    tier = h.tiers[0]
    #: Per call: (seconds, chunks moved, whether a cyclic-GC pass ran inside it).
    samples: dict[str, list[tuple[float, int, bool]]] = {
        m: [] for m in ("submit_store", "submit_load", "lookup", "get_finished_jobs")}
    #: Per call without a GC pass: net GC-tracked objects it left allocated.
    net_allocs: dict[str, list[int]] = {m: [] for m in samples}
    originals = {m: getattr(tier, m) for m in samples}

    job_chunks_by_id: dict[int, int] = {}
    gc_passes = [0]  # cyclic-GC passes started so far (any thread)

    def count_gc(phase: str, _info: dict[str, Any]) -> None:
        gc_passes[0] += phase == "start"

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*a: Any) -> Any:
            g0 = gc_passes[0]
            n0 = gc.get_count()[0]
            t0 = time.perf_counter()
            out = fn(*a)
            if name == "get_finished_jobs":
                out = list(out)
            dt = time.perf_counter() - t0
            n1 = gc.get_count()[0]
            # Python's cyclic GC ran inside this call: it collects the whole
            # process's garbage and starts in whichever thread allocates past
            # the threshold. Kept in p99, left out of p99 "no GC".
            gc_ran = gc_passes[0] != g0
            if not gc_ran:
                # Allocations minus frees of GC-tracked objects (a pass resets
                # the counter): a pass starts every gc.get_threshold()[0] net
                # allocations, so this is the call's share of them. I/O threads
                # allocate too, but rarely inside a call of microseconds that
                # holds the GIL throughout.
                net_allocs[name].append(n1 - n0)
            # Per chunk: a submit's keys; a poll's chunks are those of the jobs
            # it reported (vLLM may send 1-chunk jobs to one tier, 16 to
            # another); a poll that reported nothing moved none (left out of
            # the per-chunk figures).
            chunks = 1
            if name.startswith("submit"):
                chunks = job_chunks_by_id[a[0].job_id] = len(a[0].keys)
            elif name == "get_finished_jobs":
                chunks = sum(job_chunks_by_id.get(r.job_id, 1) for r in out)
            samples[name].append((dt, chunks, gc_ran))
            return out
        return wrapper

    gc.callbacks.append(count_gc)
    try:
        for m, fn in originals.items():
            setattr(tier, m, timed(m, fn))
        rows = np.random.default_rng(1).integers(0, 256, (job_chunks, chunk), dtype=np.uint8)
        phase_rng = np.random.default_rng(gc_phase_seed)
        for wave in range(waves):
            phase = ([[] for _ in range(int(phase_rng.integers(0, gc.get_threshold()[0])))]
                     if gc_phase_seed is not None else [])
            keys = make_keys(in_flight, seed=77 + wave)
            if before_wave is not None:
                before_wave(tier, keys)
            ctx = h.new_request()
            jobs = [keys[s:s + job_chunks] for s in range(0, in_flight, job_chunks)]
            with h.locked():
                # The rows are written first (the GPU worker's part: vLLM's
                # scheduler thread never copies KV bytes, and megabytes of
                # copying between the calls would leave them all cache-cold),
                # then ~in_flight chunks of stores are queued at once.
                for ks in jobs:
                    out = h.manager.prepare_store(ks, ctx)
                    for cid, row in zip(np.asarray(out.store_spec.chunk_ids), rows, strict=False):
                        h.view[int(cid)] = row
                for ks in jobs:
                    h.manager.complete_store(ks, ctx)
            _settle(h)
            h.finish_request(ctx)
            h.forget_primary()
            if promote:
                # Same manager: lookups answered by presence (ours) or async (stock).
                ctxs = [h.new_request() for _ in range(0, in_flight, job_chunks)]
                promote_all(h, [(c, keys[s:s + job_chunks]) for c, s in
                                zip(ctxs, range(0, in_flight, job_chunks), strict=True)])
                for c in ctxs:
                    h.finish_request(c)
                h.forget_primary()
            del phase
    finally:
        gc.callbacks.remove(count_gc)
        for m, fn in originals.items():
            setattr(tier, m, fn)
        h.shutdown()

    def pct(xs: list[float], q: float) -> float:
        return float(np.percentile(xs, q)) * 1e6 if xs else float("nan")

    report: dict[str, dict[str, float]] = {}
    for name, xs in samples.items():
        per_call = [t for t, _, _ in xs]
        per_chunk = [t / c for t, c, _ in xs if c]
        no_gc = [(t, c) for t, c, gc_ran in xs if not gc_ran]
        report[name] = {"calls": len(xs), "p50_us": pct(per_call, 50), "p99_us": pct(per_call, 99),
                        "total_us": sum(per_call) * 1e6,
                        "p50_us_per_chunk": pct(per_chunk, 50),
                        "p99_us_per_chunk": pct(per_chunk, 99),
                        "gc_calls": len(xs) - len(no_gc),
                        "p99_us_no_gc": pct([t for t, _ in no_gc], 99),
                        "p99_us_per_chunk_no_gc": pct([t / c for t, c in no_gc if c], 99),
                        "net_gc_allocs": float(np.mean(net_allocs[name]))
                        if net_allocs[name] else float("nan")}
    # A poll that reported nothing does well under a microsecond of work: its
    # p99 is this machine's own noise on the scheduler thread (interrupts and
    # the hypervisor, charged to whatever runs), in the same run.
    empty = [t for t, c, gc_ran in samples["get_finished_jobs"] if not gc_ran and c == 0]
    report["get_finished_jobs"]["p99_us_empty_polls"] = pct(empty, 99)
    report["get_finished_jobs"]["empty_polls"] = len(empty)
    return report


# ------------------------------------------------------------------------ main
def run(directory: Path, chunk_sizes: list[int], total_bytes: int, rounds: int,
        progress: Callable[[str], None] = print, *,
        samples_dir: Path | None = None, compression_mib: int = 32,
        scheduler_in_flight: int = 1024, reload: int = 0,
        on_row: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every measurement of this module, in one result dict (see the module doc).

    ``samples_dir``: real KV samples (:mod:`kvstore_tiers.tools.samples`) for
    the compression variants (skipped if None); ``reload``: rounds of
    :func:`reload_rounds` per chunk size and request count (0: none);
    ``on_row``: called with each throughput row as it is done.
    """
    from kvstore_tiers.plugin import register

    register()  # makes "vllm_fs" available next to our "fs"
    rounds = even_rounds(rounds)
    result: dict[str, Any] = {"directory": str(directory), "rounds": rounds, "throughput": [],
                              "reload": [], "disk_o_direct": probe_o_direct(str(directory)),
                              "disk": {}, "scheduler": {}, "scheduler_gc_random_phase": {}}
    for chunk in chunk_sizes:
        n = window_chunks(chunk, total_bytes)
        threads = 8
        disk = [disk_o_direct(directory, chunk, total_bytes, threads, result["disk_o_direct"])
                for _ in range(rounds)]
        result["disk"][chunk] = {k: statistics.median(d[k] for d in disk) for k in disk[0]}
        mode = "O_DIRECT" if result["disk_o_direct"] else "buffered (no O_DIRECT here)"
        progress(f"disk {mode} at {chunk // KiB} KiB: {result['disk'][chunk]}")
        for n_req in (1, 4):
            row = throughput_row(directory, chunk, n, n_req, rounds, result["disk"][chunk])
            result["throughput"].append(row)
            progress(f"{chunk // KiB} KiB x{n_req}: " + ", ".join(
                f"{k}={v:.3f}" for k, v in row.items() if isinstance(v, float)))
            if on_row is not None:
                on_row(row)
        for n_req in (1, 4) if reload else ():
            rr = reload_rounds(directory, chunk, n, n_req, reload)
            result["reload"].append(rr)
            progress(f"reload {chunk // KiB} KiB x{n_req}: ours/vLLM {rr['load_ratio']:.3f} "
                     f"(95% CI {rr['load_ratio_ci95'][0]:.3f}-{rr['load_ratio_ci95'][1]:.3f})")
    # The harness as it is (the GC's phase fixed by the waves), then with the
    # phase drawn at random per wave (see scheduler_cost), same seed for both tiers.
    # 32 random waves: a pass lands in a few calls of a thousand, so the
    # count of them is what needs the samples.
    for section, seed, waves in (("scheduler", None, 16), ("scheduler_gc_random_phase", 5, 32)):
        for kind in TIERS:
            root = Path(tempfile.mkdtemp(prefix=f"bench-sched-{kind}-", dir=directory))
            try:
                result[section][kind] = scheduler_cost(kind, root, 256 * KiB, 16,
                                                       scheduler_in_flight, waves=waves,
                                                       gc_phase_seed=seed)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            progress(f"scheduler-thread cost ({kind}, {section}): {result[section][kind]}")
    if samples_dir is not None:
        root = Path(tempfile.mkdtemp(prefix="bench-codec-", dir=directory))
        try:
            result["compression"] = compression_bench(root, samples_dir, compression_mib * MiB)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        progress(f"compression: {result['compression']}")
    return result


# ------------------------------------------------------------ compression variants
def compression_bench(directory: Path, samples_dir: Path, total_bytes: int,
                      codecs: tuple[str, ...] = ("none", "zstd", "kvsplit")
                      ) -> list[dict[str, Any]]:
    """Our fs tier storing and loading the real bf16 KV samples with each codec.

    The sample blocks are repeated (under distinct keys) up to ``total_bytes``
    per file; each block is still encoded on its own, so the ratio is the
    per-block ratio. Reports ratio = raw / stored bytes and *effective* GB/s
    (raw KV bytes moved per second, what the engine sees), store and load,
    through vLLM's manager like the throughput rounds.
    """
    out = []
    for entry, blocks in kv_samples.load(samples_dir):
        fname = entry["file"]
        bb = blocks.shape[1]
        n = max(4, total_bytes // bb)
        n -= n % 4
        rows = blocks[np.arange(n) % len(blocks)]
        for codec in codecs:
            root = Path(tempfile.mkdtemp(prefix=f"codec-{codec}-", dir=directory))
            try:
                cfg = {"type": "fs", "root_dir": str(root), "compression": codec}
                h = build_harness([cfg], num_chunks=n, chunk_bytes=bb)
                try:
                    keys = make_keys(n, seed=5)
                    t0 = time.perf_counter()
                    ctx = h.store(keys, rows)
                    _settle(h)
                    store_dt = time.perf_counter() - t0
                    h.finish_request(ctx)
                    c = h.tiers[0].counters
                    raw, stored = c.raw_bytes_written, c.stored_bytes_written
                finally:
                    h.shutdown()
                h = build_harness([cfg], num_chunks=n, chunk_bytes=bb)
                try:
                    ctx = h.new_request()
                    t0 = time.perf_counter()
                    promote_all(h, [(ctx, keys)])
                    load_dt = time.perf_counter() - t0
                    back = h.load(keys[:1], ctx)
                    if not np.array_equal(back[0], rows[0]):
                        raise RuntimeError(f"{codec}: block read back differs")
                    h.finish_request(ctx)
                finally:
                    h.shutdown()
            finally:
                shutil.rmtree(root, ignore_errors=True)
            out.append({"file": fname, "block_bytes": bb, "blocks": n, "codec": codec,
                        "ratio": raw / stored if stored else float("nan"),
                        "store_effective_gbps": n * bb / store_dt / 1e9,
                        "load_effective_gbps": n * bb / load_dt / 1e9})
    return out
