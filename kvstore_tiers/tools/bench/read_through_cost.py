"""What read-through costs the load it caches: a paired A/B through vLLM's real manager.

``python -m kvstore_tiers.tools.bench.read_through_cost --pairs 6``

Every run is a fresh process (:func:`measure`): per round, engine A stores
``--blocks`` blocks of ``--chunk-kib`` to ``[fs, redis]``; one manager B,
``[fs (read_through off or on), redis]`` with an empty fs root on tmpfs,
looks that round's blocks up and loads them from redis (timed: the first
lookup to every block loaded), then steps until its fills are written.
Round 1's copies go into new buffers; later rounds reuse them (their best
load is reported). Every tier call vLLM's scheduler makes on B is timed.

Arms (``--arm NAME=CHECKOUT:on|off``, default the installed code off and
on) run alternately, the order reversed every pair, against one
redis-server started here. Reports, per arm, the medians, and per other
arm its ratio to the first arm (geometric mean over pairs, 95 % interval).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from kvstore_tiers.tools.bench.pairing import geomean_interval

METHODS = ("lookup", "submit_load", "submit_store", "get_finished_jobs", "on_schedule_end")
FIGURES = ("first_load_s", "reused_load_s", "call_p99_us")


def measure(url: str, read_through: bool, blocks: int = 32, chunk_bytes: int = 2 << 20,
            rounds: int = 4, directory: str = "/dev/shm") -> dict[str, Any]:
    """One arm in this process (see the module docstring): load times and call p99."""
    from kvstore_tiers.admin.harness import build_harness, make_keys

    rows = np.random.default_rng(0).integers(0, 256, (blocks, chunk_bytes), dtype=np.uint8)
    calls: list[int] = []
    da, db = tempfile.mkdtemp(dir=directory), tempfile.mkdtemp(dir=directory)
    a = build_harness([{"type": "fs", "root_dir": da}, {"type": "redis", "url": url}],
                      chunk_bytes=chunk_bytes, num_chunks=blocks + 8)
    b = build_harness([{"type": "fs", "root_dir": db, "read_through": read_through},
                       {"type": "redis", "url": url}],
                      chunk_bytes=chunk_bytes, num_chunks=2 * blocks + 8)
    try:
        for tier in b.tiers:
            for m in METHODS:
                setattr(tier, m, _timed(getattr(tier, m), calls))
        times = []
        for rnd in range(rounds):
            keys = make_keys(blocks, seed=time.time_ns() % 1_000_000_007 + rnd)
            a.store_all(keys, rows)
            ctx = b.new_request()
            t0 = time.perf_counter()
            results, _ = b.lookup_until_resolved(keys, ctx, timeout_s=300)
            times.append(time.perf_counter() - t0)
            b.finish_request(ctx)
            b.settle()  # the fills too: the caching tier has pending work until written
            b.forget_primary()
        counters = b.tiers[0].counters
        return {"first_load_s": times[0], "reused_load_s": min(times[1:] or times),
                "cached": counters.read_through_stored,
                "loaded": sum(r.name == "HIT" for r in results),
                "call_p99_us": float(np.percentile(calls, 99)) / 1e3, "calls": len(calls)}
    finally:
        a.shutdown()
        b.shutdown()
        shutil.rmtree(da, ignore_errors=True)
        shutil.rmtree(db, ignore_errors=True)


def _timed(fn: Any, calls: list[int]) -> Any:
    def wrap(*a: Any, **k: Any) -> Any:
        t = time.perf_counter_ns()
        try:
            return fn(*a, **k)
        finally:
            calls.append(time.perf_counter_ns() - t)
    return wrap


def _run_arm(checkout: str | None, url: str, read_through: bool, args: Any) -> dict[str, Any]:
    env = dict(os.environ)
    if checkout:
        env["PYTHONPATH"] = checkout
    code = ("import json, sys; from kvstore_tiers.tools.bench.read_through_cost import measure;"
            "print(json.dumps(measure(*json.loads(sys.argv[1]))))")
    argv = [url, read_through, args.blocks, args.chunk_kib << 10, args.rounds, args.dir]
    out = subprocess.run([sys.executable, "-c", code, json.dumps(argv)], env=env, check=True,
                         capture_output=True, text=True, cwd=tempfile.gettempdir())
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=6)
    p.add_argument("--arm", action="append", default=[],
                   help="NAME=CHECKOUT:on|off (CHECKOUT empty: the installed code)")
    p.add_argument("--blocks", type=int, default=32)
    p.add_argument("--chunk-kib", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--dir", default="/dev/shm")
    args = p.parse_args(argv)
    arms = {}
    for spec in args.arm or ["off=:off", "on=:on"]:
        name, _, rest = spec.partition("=")
        checkout, _, side = rest.rpartition(":")
        if not name or side not in ("on", "off"):
            p.error(f"--arm {spec!r}: expected NAME=CHECKOUT:on|off")
        arms[name] = (checkout or None, side == "on")
    from kvstore_tiers.tools.bench.trace import redis_for_trace

    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in arms}
    with redis_for_trace() as (url, client):
        for i in range(args.pairs):
            for name in (list(arms) if i % 2 == 0 else list(arms)[::-1]):
                client.flushall()
                checkout, read_through = arms[name]
                runs[name].append(_run_arm(checkout, url, read_through, args))
                print(i + 1, name, json.dumps(runs[name][-1]), flush=True)
    base = next(iter(arms))
    report: dict[str, Any] = {"medians": {n: {f: float(np.median([r[f] for r in rs]))
                                              for f in FIGURES} for n, rs in runs.items()},
                              "ratios": {}, "runs": runs}
    for name in list(arms)[1:]:
        report["ratios"][f"{name}/{base}"] = {f: geomean_interval(
            [x[f] / y[f] for x, y in zip(runs[name], runs[base], strict=True)]) for f in FIGURES}
    print(json.dumps({k: report[k] for k in ("medians", "ratios")}, indent=1))
    return report


if __name__ == "__main__":
    main()
