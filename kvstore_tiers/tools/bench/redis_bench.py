"""Redis tier benchmark: bandwidth against redis-benchmark, memory per block.

Run by ``kvstore-tiers bench --tier redis``. Without a URL it starts its own
``redis-server`` on a free loopback port (no persistence), then, in the same
run and against the same server:

1. **Bandwidth.** ``redis-benchmark -t set,get -d <block>`` with as many
   connections (4) as the tier has store threads (its default
   ``n_write_threads``), and the tier driven through
   vLLM's real TieringOffloadingManager (:mod:`kvstore_tiers.admin.harness`): one
   store job of ``--blocks`` chunks (cascade primary -> Redis), then, after
   the primary forgot them, one request that looks them up and loads them
   back (Redis -> primary). Incompressible bytes and ``compression: none``,
   so both move the same bytes; rounds alternate which side goes first, and a
   ratio is balanced over AB/BA round pairs (:mod:`kvstore_tiers.tools.bench.pairing`).
2. **Memory.** The real KV samples (``shared/data/kv-samples`` beside the checkout) stored
   with ``compression: none`` and with ``kvsplit``; Redis ``MEMORY USAGE``
   per key and the ``used_memory`` delta, per block.

With ``url`` (``--redis-url``: the user's own server) nothing is flushed,
pinned or started: the tier writes under a fresh ``key_prefix``, the baseline
is a plain redis-py loop (``threads`` connections, pipelines of ``batch``
SET/GET of the same values under its own fresh prefix; redis-benchmark would
write keys outside any prefix), every key both wrote is deleted afterwards,
and the memory measurement (a ``used_memory`` delta) is skipped. The URL may
carry credentials; reports show only host, port and database.

CPU seconds per GB (:mod:`kvstore_tiers.tools.bench.cpu`): the tier's, and
with ``url`` the redis-py loop's; redis-benchmark and redis-server are other
processes, not counted.

Returns a dict of the numbers (:mod:`kvstore_tiers.tools.bench.tables` prints it).
"""

from __future__ import annotations

import contextlib
import csv
import io
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from kvstore_tiers.tools import samples
from kvstore_tiers.tools.bench.cpu import CpuClock
from kvstore_tiers.tools.bench.pairing import balanced_ratio, even_rounds, round_ratios

MiB = 1 << 20


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
    Each window also gives this process's CPU seconds per GB
    (``*_cpu_s_per_gb``: :class:`~kvstore_tiers.tools.bench.cpu.CpuClock`).

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
    from kvstore_tiers.admin.harness import make_keys

    keys = make_keys(len(rows), seed=seed)
    nbytes = rows.nbytes
    tier = h.tiers[0]
    ctx = h.new_request()
    with h.locked():
        out = h.manager.prepare_store(list(keys), ctx)
        view = h.view
        for cid, i in zip(np.asarray(out.store_spec.chunk_ids), range(len(keys)), strict=True):
            view[int(cid)] = rows[i]
        t0, cpu = time.perf_counter(), CpuClock()
        h.manager.complete_store(list(keys), ctx)
    h.settle()
    t_store, store_cpu = time.perf_counter() - t0, cpu.per_gb(nbytes)
    h.finish_request(ctx)

    def check(ctx: Any) -> int:
        results, _ = h.lookup_until_resolved(keys, ctx)
        got = h.load(keys, ctx)
        h.finish_request(ctx)
        if not np.array_equal(got, rows):
            raise AssertionError("tier returned different bytes")
        return sum(r.name == "HIT" for r in results)

    def end_to_end() -> tuple[float, float, int]:
        h.forget_primary()
        ctx = h.new_request()
        t0, cpu = time.perf_counter(), CpuClock()
        h.lookup_until_resolved(keys, ctx)
        t, cpu_per_gb = time.perf_counter() - t0, cpu.per_gb(nbytes)
        return t, cpu_per_gb, check(ctx)

    def transfer_only() -> tuple[float, float, int]:
        h.forget_primary()
        ctx = h.new_request()
        submitted: list[float] = []
        cpu_at_submit: list[CpuClock] = []
        submit_load = tier.submit_load

        def timed_submit(job: Any) -> None:
            submitted.append(time.perf_counter())
            cpu_at_submit.append(CpuClock())
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
            tier.pool.wait_idle()
            t, cpu_per_gb = time.perf_counter() - submitted[0], cpu_at_submit[0].per_gb(nbytes)
        finally:
            del tier.submit_load
        return t, cpu_per_gb, check(ctx)

    windows = (end_to_end, transfer_only) if seed % 2 else (transfer_only, end_to_end)
    measured = {fn.__name__: fn() for fn in windows}
    (t_e2e, e2e_cpu, hits), (t_xfer, xfer_cpu, _) = (measured["end_to_end"],
                                                     measured["transfer_only"])
    return {"set": nbytes / t_store / MiB, "get": nbytes / t_e2e / MiB,
            "get_transfer": nbytes / t_xfer / MiB, "hits": hits,
            "set_cpu_s_per_gb": store_cpu, "get_cpu_s_per_gb": e2e_cpu,
            "get_transfer_cpu_s_per_gb": xfer_cpu}


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

    from kvstore_tiers.admin.harness import build_harness

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
        **_tier_cpu(tier),
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

    from kvstore_tiers.admin.harness import build_harness, make_keys

    results = []
    for entry, blocks in samples.load(samples_dir):
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


def server_label(url: str) -> str:
    """``host:port/db`` of a Redis URL: what a report may show (never credentials)."""
    parts = urlsplit(url)
    db = parts.path.lstrip("/") or "0"
    return f"{parts.hostname}:{parts.port or 6379}/{db}"


def _delete_prefix(client: Any, prefix: str) -> None:
    """Delete every key under ``prefix`` (SCAN, not KEYS: the server may be in use)."""
    batch: list[bytes] = []
    for key in client.scan_iter(match=f"{prefix}*", count=1000):
        batch.append(key)
        if len(batch) >= 500:
            client.delete(*batch)
            batch.clear()
    if batch:
        client.delete(*batch)


def _tier_cpu(tier: list[dict[str, float]]) -> dict[str, float]:
    """The tier's CPU s per GB of each window, median of rounds (redis-server's not counted)."""
    return {f"tier_{op}_cpu_s_per_gb": statistics.median(t[f"{op}_cpu_s_per_gb"] for t in tier)
            for op in ("set", "get", "get_transfer")}


def raw_client_round(url: str, prefix: str, rows: np.ndarray, clients: int, batch: int
                     ) -> dict[str, float]:
    """MiB/s of SET then GET of ``rows`` by a plain redis-py loop: ``clients``
    threads, one connection each, pipelines of ``batch`` commands, keys under
    ``prefix`` (the baseline on a server this benchmark did not start); and
    this process's CPU s per GB of each (``set_cpu_s_per_gb``, ``get_cpu_s_per_gb``)."""
    import redis

    pool = redis.ConnectionPool.from_url(url, max_connections=clients)
    client = redis.Redis(connection_pool=pool)
    keys = [f"{prefix}{i:06d}" for i in range(len(rows))]
    parts = [range(c, len(rows), clients) for c in range(clients)]

    def run(op: str) -> tuple[float, float]:
        def work(idx: range) -> int:
            got = 0
            ids = list(idx)
            for s in range(0, len(ids), batch):
                pipe = client.pipeline(transaction=False)
                for i in ids[s:s + batch]:
                    if op == "set":
                        pipe.set(keys[i], memoryview(rows[i]))
                    else:
                        pipe.get(keys[i])
                out = pipe.execute()
                if op == "get":
                    got += sum(len(v) for v in out if v is not None)
            return got

        t0, cpu = time.perf_counter(), CpuClock()
        with ThreadPoolExecutor(clients) as ex:
            got = sum(ex.map(work, parts))
        dt, cpu_per_gb = time.perf_counter() - t0, cpu.per_gb(rows.nbytes)
        if op == "get" and got != rows.nbytes:
            raise RuntimeError(f"raw GET returned {got} of {rows.nbytes} bytes")
        return rows.nbytes / dt / MiB, cpu_per_gb

    try:
        (set_mibps, set_cpu), (get_mibps, get_cpu) = run("set"), run("get")
        return {"set": set_mibps, "get": get_mibps, "set_cpu_s_per_gb": set_cpu,
                "get_cpu_s_per_gb": get_cpu}
    finally:
        _delete_prefix(client, prefix)
        pool.disconnect()


def external_bandwidth(url: str, block_bytes: int, blocks: int, rounds: int, threads: int,
                       batch: int, read_threads: int = 2) -> dict[str, Any]:
    """:func:`bandwidth` against the user's server at ``url``: tier vs
    :func:`raw_client_round`, alternating, under fresh prefixes, cleaned up."""
    import redis

    from kvstore_tiers.admin.harness import build_harness

    rounds = even_rounds(rounds)
    run_id = uuid.uuid4().hex[:10]
    tier_prefix, raw_prefix = f"kvbench-{run_id}:tier:", f"kvbench-{run_id}:raw:"
    rows = np.random.default_rng(0).integers(0, 256, (blocks, block_bytes), dtype=np.uint8)
    raw: list[dict[str, float]] = []
    tier: list[dict[str, float]] = []
    admin = redis.Redis.from_url(url)
    h = build_harness(
        [{"type": "redis", "url": url, "compression": "none", "key_prefix": tier_prefix,
          "n_read_threads": read_threads, "n_write_threads": threads,
          "pipeline_batch": batch, "presence_capacity": 0}],
        num_chunks=blocks, chunk_bytes=block_bytes,
    )
    try:
        for r in range(rounds):
            if r % 2:
                raw.append(raw_client_round(url, raw_prefix, rows, threads, batch))
            tier.append(tier_round(h, rows, seed=1000 + r))
            _delete_prefix(admin, tier_prefix)
            if not r % 2:
                raw.append(raw_client_round(url, raw_prefix, rows, threads, batch))
    finally:
        h.shutdown()
        _delete_prefix(admin, tier_prefix)
        _delete_prefix(admin, raw_prefix)
        admin.close()

    def med(xs: list[dict[str, float]], k: str) -> float:
        return statistics.median(x[k] for x in xs)

    out: dict[str, Any] = {
        "server": server_label(url), "baseline": "redis-py pipelined loop",
        "block_bytes": block_bytes, "blocks": blocks, "rounds": rounds,
        "connections": threads, "read_connections": read_threads, "pipeline_batch": batch,
        "placement": "off",
        "raw_client_set_MiBps": med(raw, "set"), "raw_client_get_MiBps": med(raw, "get"),
        "tier_set_MiBps": med(tier, "set"), "tier_get_MiBps": med(tier, "get"),
        "tier_get_transfer_MiBps": med(tier, "get_transfer"),
        **_tier_cpu(tier),
        "raw_client_set_cpu_s_per_gb": med(raw, "set_cpu_s_per_gb"),
        "raw_client_get_cpu_s_per_gb": med(raw, "get_cpu_s_per_gb"),
    }
    for op, base_op in (("set", "set"), ("get", "get"), ("get_transfer", "get")):
        ours, theirs = [t[op] for t in tier], [b[base_op] for b in raw]
        out[f"{op}_ratio_raw"] = balanced_ratio(ours, theirs)
        out[f"{op}_ratios_raw"] = round_ratios(ours, theirs)
    return out


def run(block_bytes: int = 2 * MiB, blocks: int = 256, rounds: int = 5, threads: int = 4,
        batch: int = 8, samples_dir: Path | None = None, read_threads: int = 2,
        pin: str = "split", url: str | None = None) -> dict[str, Any]:
    """Both benchmarks; returns ``{"bandwidth": {...}, "memory": [...]}``.

    ``url``: the user's server (see the module doc); None starts one here.
    ``samples_dir``: real KV samples for the memory measurement (skipped if None)."""
    if url is not None:
        return {"bandwidth": external_bandwidth(url, block_bytes, blocks, rounds, threads,
                                                batch, read_threads)}
    out: dict[str, Any] = {"bandwidth": bandwidth(block_bytes, blocks, rounds, threads, batch,
                                                  read_threads, pin)}
    out["bandwidth"].update(server="redis-server started by the benchmark",
                            baseline="redis-benchmark")
    if samples_dir is not None:
        out["memory"] = memory(samples_dir)
    return out
