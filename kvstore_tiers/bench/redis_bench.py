"""Redis tier benchmark: bandwidth against redis-benchmark, memory per block.

Run ``python -m kvstore_tiers.bench.redis_bench`` (options: ``--help``). It
starts its own ``redis-server`` on a free loopback port (no persistence),
then, in the same run and against the same server:

1. **Bandwidth.** ``redis-benchmark -t set,get -d <block>`` with as many
   connections (4) as the tier has store threads (its default
   ``n_write_threads``), and the tier driven through
   vLLM's real TieringOffloadingManager (:mod:`kvstore_tiers.harness`): one
   store job of ``--blocks`` chunks (cascade primary -> Redis), then, after
   the primary forgot them, one request that looks them up and loads them
   back (Redis -> primary). Incompressible bytes and ``compression: none``,
   so both move the same bytes; rounds alternate which side goes first, and a
   ratio is balanced over AB/BA round pairs (:mod:`kvstore_tiers.bench.pairing`).
2. **Memory.** The real KV samples (``shared/data/kv-samples`` beside the checkout) stored
   with ``compression: none`` and with ``kvsplit``; Redis ``MEMORY USAGE``
   per key and the ``used_memory`` delta, per block.

Returns (and prints as a table) a dict of the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvstore_tiers import samples
from kvstore_tiers.bench.pairing import balanced_ratio, even_rounds, round_ratios

MiB = 1 << 20
DEFAULT_SAMPLES = samples.default_dir()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def redis_server(extra: list[str] | None = None) -> Iterator[int]:
    """A throwaway redis-server on 127.0.0.1; yields its port."""
    import redis

    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server not found (apt-get install redis-server)")
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="kvstore-redis-bench-") as d:
        proc = subprocess.Popen(
            [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
             "no", "--dir", d, *(extra or [])],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    if redis.Redis(port=port).ping():
                        break
                except redis.ConnectionError:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise
                    time.sleep(0.01)
            yield port
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def _rb(port: int, test: str, value_bytes: int, requests: int, clients: int,
        keyspace: int | None) -> float:
    """Requests per second of one redis-benchmark test."""
    exe = shutil.which("redis-benchmark")
    if exe is None:
        raise SystemExit("redis-benchmark not found (apt-get install redis-tools)")
    cmd = [exe, "-h", "127.0.0.1", "-p", str(port), "-t", test, "-d", str(value_bytes),
           "-n", str(requests), "-c", str(clients), "--csv"]
    if keyspace:
        cmd += ["-r", str(keyspace)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600).stdout
    for row in csv.reader(io.StringIO(out)):
        if row and row[0] == test.upper():
            return float(row[1])
    raise RuntimeError(f"unexpected redis-benchmark output: {out!r}")


def redis_benchmark(port: int, value_bytes: int, requests: int, clients: int,
                    distinct_keys: int | None = None) -> dict[str, float]:
    """MiB/s of SET and GET from redis-benchmark (same value size).

    ``distinct_keys=None``: redis-benchmark's default, every request on one
    key (the server overwrites one value in place; GET reads one cache-hot
    value). ``distinct_keys=N``: the tier's workload shape -- every SET a new
    key (``-r 10^9``), and GETs spread over N populated keys (``-r N``).
    """
    if not distinct_keys:
        return {op: _rb(port, op, value_bytes, requests, clients, None) * value_bytes / MiB
                for op in ("set", "get")}
    set_rps = _rb(port, "set", value_bytes, requests, clients, 10**9)
    _rb(port, "set", value_bytes, 8 * distinct_keys, clients, distinct_keys)  # populate
    get_rps = _rb(port, "get", value_bytes, requests, clients, distinct_keys)
    return {"set": set_rps * value_bytes / MiB, "get": get_rps * value_bytes / MiB}


def tier_round(h: Any, rows: np.ndarray, seed: int) -> dict[str, float]:
    """MiB/s of one store job and one load request through vLLM's manager.

    Store: timed from ``complete_store`` (the cascade to the tier is
    submitted) until the job's result is consumed -- the rows are written
    into the primary before the clock starts (that is the GPU worker's part).

    The load is done twice from the same stored keys (the primary forgets
    them in between), alternating which goes first:

    * ``get``, end to end: from the first lookup of a new request until
      every key is HIT, i.e. the existence checks (pipelined EXISTS: this
      benchmark turns the presence index off), the promotion job (Redis ->
      primary) and the scheduler polling that consumes its result;
    * ``get_transfer``: from the promotion job's ``submit_load`` until the
      tier's I/O pool is idle -- the GETs and the frame checks into the
      rows, the work ``redis-benchmark -t get`` measures.
    """
    from kvstore_tiers.harness import make_keys

    keys = make_keys(len(rows), seed=seed)
    nbytes = rows.nbytes
    tier = h.tiers[0]
    ctx = h.new_request()
    with h.locked():
        out = h.manager.prepare_store(list(keys), ctx)
        view = h.view
        for cid, i in zip(np.asarray(out.store_spec.chunk_ids), range(len(keys)), strict=True):
            view[int(cid)] = rows[i]
        t0 = time.perf_counter()
        h.manager.complete_store(list(keys), ctx)
    h.settle()
    t_store = time.perf_counter() - t0
    h.finish_request(ctx)

    def check(ctx: Any) -> int:
        results, _ = h.lookup_until_resolved(keys, ctx)
        got = h.load(keys, ctx)
        h.finish_request(ctx)
        if not np.array_equal(got, rows):
            raise AssertionError("tier returned different bytes")
        return sum(r.name == "HIT" for r in results)

    def end_to_end() -> tuple[float, int]:
        h.forget_primary()
        ctx = h.new_request()
        t0 = time.perf_counter()
        h.lookup_until_resolved(keys, ctx)
        t = time.perf_counter() - t0
        return t, check(ctx)

    def transfer_only() -> tuple[float, int]:
        h.forget_primary()
        ctx = h.new_request()
        submitted: list[float] = []
        submit_load = tier.submit_load

        def timed_submit(job: Any) -> None:
            submitted.append(time.perf_counter())
            submit_load(job)

        tier.submit_load = timed_submit
        try:
            for _ in range(10_000):
                with h.locked():
                    for k in keys:
                        h.manager.lookup(k, ctx)
                if submitted:
                    break
                h.step()
                time.sleep(0.0005)
            tier._pool.wait_idle()
            t = time.perf_counter() - submitted[0]
        finally:
            del tier.submit_load
        return t, check(ctx)

    windows = (end_to_end, transfer_only) if seed % 2 else (transfer_only, end_to_end)
    measured = {fn.__name__: fn() for fn in windows}
    (t_e2e, hits), (t_xfer, _) = measured["end_to_end"], measured["transfer_only"]
    return {"set": nbytes / t_store / MiB, "get": nbytes / t_e2e / MiB,
            "get_transfer": nbytes / t_xfer / MiB, "hits": hits}


@contextlib.contextmanager
def server_on_own_cpu(server_pid: int, mode: str) -> Iterator[str]:
    """``mode="split"``: pin redis-server to the last CPU and this thread (so
    the tier's I/O threads and redis-benchmark, started inside) to the others;
    ``"server"``: pin only redis-server; ``"off"``: pin nothing.

    Why: in production Redis runs on its own host; on a 2-core VM a
    multi-threaded client otherwise takes turns with the single-threaded
    server on the same cores, and what is measured is the scheduler's
    fairness rather than the client. Both sides run under the same pinning.
    Yields a description of the placement (``"off"`` when not pinned).
    """
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if mode not in ("split", "server", "off"):
        raise ValueError(f"pin mode {mode!r}: expected split, server or off")
    if mode == "off" or len(cpus) < 2:
        yield "off"
        return
    os.sched_setaffinity(server_pid, {cpus[-1]})
    if mode == "server":
        yield f"redis-server on CPU {cpus[-1]}, clients anywhere"
        return
    os.sched_setaffinity(0, set(cpus[:-1]))
    try:
        yield f"redis-server on CPU {cpus[-1]}, clients on CPU {','.join(map(str, cpus[:-1]))}"
    finally:
        os.sched_setaffinity(0, set(cpus))


def bandwidth(block_bytes: int, blocks: int, rounds: int, threads: int,
              batch: int, read_threads: int = 2, pin: str = "split") -> dict[str, Any]:
    """``threads``: the tier's store threads and redis-benchmark's clients;
    ``read_threads``: the tier's load threads (fewer than redis-benchmark's
    clients: on 2 cores, 4 Python load threads beside redis-server measured
    ~25 % slower than 2); ``pin``: see :func:`server_on_own_cpu`."""
    import redis

    from kvstore_tiers.harness import build_harness

    rounds = even_rounds(rounds)
    rows = np.random.default_rng(0).integers(0, 256, (blocks, block_bytes), dtype=np.uint8)
    bench: list[dict[str, float]] = []
    bench_keys: list[dict[str, float]] = []
    tier: list[dict[str, float]] = []
    with contextlib.ExitStack() as stack:
        port = stack.enter_context(redis_server(["--maxmemory", "0"]))
        admin = redis.Redis(port=port)
        stack.callback(admin.close)
        placement = stack.enter_context(
            server_on_own_cpu(int(admin.info("server")["process_id"]), pin))
        h = build_harness(
            [{"type": "redis", "url": f"redis://127.0.0.1:{port}/0", "compression": "none",
              "n_read_threads": read_threads, "n_write_threads": threads,
              "pipeline_batch": batch,
              "presence_capacity": 0}],
            num_chunks=blocks, chunk_bytes=block_bytes,
        )
        try:
            for r in range(rounds):
                # Same bytes per measurement on both sides (``blocks`` values);
                # who goes first alternates, since the machine drifts.
                def baselines() -> None:
                    admin.flushall()
                    bench.append(redis_benchmark(port, block_bytes, blocks, threads))
                    admin.flushall()
                    bench_keys.append(redis_benchmark(port, block_bytes, blocks, threads,
                                                      distinct_keys=blocks))
                    admin.flushall()

                if r % 2:
                    baselines()
                tier.append(tier_round(h, rows, seed=1000 + r))
                admin.flushall()
                if not r % 2:
                    baselines()
        finally:
            h.shutdown()

    def med(xs: list[dict[str, float]], k: str) -> float:
        return statistics.median(x[k] for x in xs)

    out: dict[str, Any] = {
        "block_bytes": block_bytes, "blocks": blocks, "rounds": rounds,
        "connections": threads, "read_connections": read_threads, "pipeline_batch": batch,
        "placement": placement,
        "redis_benchmark_set_MiBps": med(bench, "set"),
        "redis_benchmark_get_MiBps": med(bench, "get"),
        "redis_benchmark_keys_set_MiBps": med(bench_keys, "set"),
        "redis_benchmark_keys_get_MiBps": med(bench_keys, "get"),
        "tier_set_MiBps": med(tier, "set"), "tier_get_MiBps": med(tier, "get"),
        "tier_get_transfer_MiBps": med(tier, "get_transfer"),
    }
    for op, base_op in (("set", "set"), ("get", "get"), ("get_transfer", "get")):
        for suffix, base in (("", bench), ("_keys", bench_keys)):
            ours, theirs = [t[op] for t in tier], [b[base_op] for b in base]
            out[f"{op}_ratio{suffix}"] = balanced_ratio(ours, theirs)
            out[f"{op}_ratios{suffix}"] = round_ratios(ours, theirs)
    return out


def memory(samples_dir: Path) -> list[dict[str, Any]]:
    """Redis memory per block of the real KV samples, none vs kvsplit."""
    import redis

    from kvstore_tiers.harness import build_harness, make_keys

    meta = json.loads((samples_dir / "kv-samples.json").read_text())
    results = []
    for entry in meta["files"]:
        blocks = np.fromfile(samples_dir / entry["file"], dtype=np.uint8).reshape(
            entry["num_blocks"], entry["block_bytes"])
        n, size = blocks.shape
        row: dict[str, Any] = {"file": entry["file"], "blocks": n, "block_bytes": size}
        for codec in ("none", "kvsplit"):
            with redis_server(["--maxmemory", "0"]) as port:
                admin = redis.Redis(port=port)
                before = int(admin.info("memory")["used_memory"])
                h = build_harness([{"type": "redis", "url": f"redis://127.0.0.1:{port}/0",
                                    "compression": codec}], num_chunks=n, chunk_bytes=size)
                try:
                    ctx = h.store(make_keys(n, seed=5), blocks)
                    h.settle()
                    h.finish_request(ctx)
                finally:
                    h.shutdown()
                keys = [k for k in admin.scan_iter(match="kvstore:*") if k.endswith(b".kvf")]
                usage = sum(int(admin.memory_usage(k, samples=0)) for k in keys)
                after = int(admin.info("memory")["used_memory"])
                admin.close()
            row[f"{codec}_memory_usage_per_block"] = usage / n
            row[f"{codec}_used_memory_delta_per_block"] = (after - before) / n
        row["kvsplit_saving"] = 1 - row["kvsplit_memory_usage_per_block"] / row[
            "none_memory_usage_per_block"]
        row["ratio"] = row["none_memory_usage_per_block"] / row["kvsplit_memory_usage_per_block"]
        results.append(row)
    return results


def run(block_bytes: int = 2 * MiB, blocks: int = 256, rounds: int = 5, threads: int = 4,
        batch: int = 8, samples_dir: Path = DEFAULT_SAMPLES, read_threads: int = 2,
        pin: str = "split") -> dict[str, Any]:
    """Both benchmarks; returns ``{"bandwidth": {...}, "memory": [...]}``."""
    out: dict[str, Any] = {"bandwidth": bandwidth(block_bytes, blocks, rounds, threads, batch,
                                                  read_threads, pin)}
    if (samples_dir / "kv-samples.json").exists():
        out["memory"] = memory(samples_dir)
    return out


def print_table(res: dict[str, Any]) -> None:
    b = res["bandwidth"]
    print(f"\nBandwidth, {b['block_bytes'] // 1024} KiB values, {b['blocks']} blocks per job, "
          f"{b['connections']} connections (tier loads: {b['read_connections']}), "
          f"median of {b['rounds']} rounds (MiB/s; ratio: balanced over AB/BA round pairs); "
          f"pinning: {b['placement']}")
    print(f"{'op':<5}{'redis-benchmark':>16}{'ratio':>7}{'redis-benchmark -r':>20}{'ratio':>7}"
          f"{'tier (vLLM manager)':>21}")
    print(f"{'':<5}{'(one key)':>16}{'':>7}{'(distinct keys)':>20}{'':>7}"
          f"{'(distinct keys)':>21}")
    for op in ("set", "get"):
        print(f"{op.upper():<5}{b[f'redis_benchmark_{op}_MiBps']:>16.0f}{b[f'{op}_ratio']:>7.2f}"
              f"{b[f'redis_benchmark_keys_{op}_MiBps']:>20.0f}{b[f'{op}_ratio_keys']:>7.2f}"
              f"{b[f'tier_{op}_MiBps']:>21.0f}")
    print(f"{'GET*':<5}{'':>16}{b['get_transfer_ratio']:>7.2f}{'':>20}"
          f"{b['get_transfer_ratio_keys']:>7.2f}{b['tier_get_transfer_MiBps']:>21.0f}"
          "   (* transfer only: submit_load until the I/O pool is idle)")
    if "memory" in res:
        print("\nRedis memory per block, real KV samples (bytes)")
        print(f"{'file':<28}{'raw block':>10}{'none':>10}{'kvsplit':>10}{'ratio':>7}"
              f"{'used_memory d none/kvsplit':>30}")
        for r in res["memory"]:
            print(f"{r['file']:<28}{r['block_bytes']:>10}"
                  f"{r['none_memory_usage_per_block']:>10.0f}"
                  f"{r['kvsplit_memory_usage_per_block']:>10.0f}{r['ratio']:>7.2f}"
                  f"{r['none_used_memory_delta_per_block']:>17.0f} /"
                  f"{r['kvsplit_used_memory_delta_per_block']:>10.0f}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block-bytes", type=int, default=2 * MiB)
    p.add_argument("--blocks", type=int, default=256,
                   help="blocks per job (and primary rows); redis-benchmark -n is the same")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=4,
                   help="tier write threads = redis-benchmark -c")
    p.add_argument("--read-threads", type=int, default=2, help="tier read threads")
    p.add_argument("--pin", choices=("split", "server", "off"), default="split",
                   help="split: redis-server on the last CPU, clients on the others; "
                   "server: only redis-server pinned; off: nothing pinned")
    p.add_argument("--batch", type=int, default=8,
                   help="pipeline_batch of the tier (8: the tier's default)")
    p.add_argument("--samples-dir", type=Path, default=DEFAULT_SAMPLES)
    p.add_argument("--json", type=Path, help="also write the result here")
    a = p.parse_args(argv)
    res = run(a.block_bytes, a.blocks, a.rounds, a.threads, a.batch, a.samples_dir,
              a.read_threads, a.pin)
    print_table(res)
    if a.json:
        a.json.write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
