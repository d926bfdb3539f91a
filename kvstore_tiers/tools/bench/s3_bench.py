"""S3 tier benchmark: tier bandwidth against a raw client loop, bytes per block, lookup cost.

Run by ``kvstore-tiers bench --tier s3``. Without a bucket it starts its own
``moto_server`` on a free loopback port; with ``--s3-bucket`` (and
``--s3-endpoint`` for MinIO and other S3-compatible servers, none for AWS)
it uses that bucket, with credentials from the usual AWS chain (environment,
shared config/profile, instance role), and writes only under
``--s3-prefix``/``kvstore-bench-<id>/``, which it empties at the end. In the
same run and against the same server:

1. **Bandwidth.** The tier driven through vLLM's real
   TieringOffloadingManager (:mod:`kvstore_tiers.admin.harness`): one store job of
   ``--blocks`` chunks (cascade primary -> S3), then, after the primary
   forgot them, one request that looks them up and loads them back. Against
   it, a raw aiobotocore loop (PutObject / GetObject of objects of the same
   size, ``--concurrency`` requests in flight, the tier's ``max_concurrency``
   too) and a boto3-on-threads loop (same concurrency, one thread per
   request in flight). Incompressible bytes and ``compression: none`` so
   everyone moves the same bytes; rounds alternate and the median is kept.
2. **Bytes per block.** The real KV samples stored with ``none`` and with
   ``kvsplit`` (what ``auto`` picks for bf16 on a remote tier).
3. **Lookup cost.** A second engine (empty presence index) looks up stored
   and absent blocks: HTTP requests sent per looked-up block.

CPU seconds per GB (:mod:`kvstore_tiers.tools.bench.cpu`) of the tier's
windows and the aiobotocore loop's PUTs and GETs; the server (moto, or
yours) is not counted.

Returns a dict of the numbers (:mod:`kvstore_tiers.tools.bench.tables` prints it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from kvstore_tiers.tools import samples
from kvstore_tiers.tools.bench.cpu import CpuClock

MiB = 1 << 20
FAKE_KEYS = {"aws_access_key_id": "AKIABENCHFAKE0000000", "aws_secret_access_key": "bench"}


@contextlib.contextmanager
def moto_server(stop_grace_s: float = 10.0) -> Iterator[str]:
    """A throwaway moto_server on 127.0.0.1 (from this interpreter's bin dir).

    On exit it is asked to stop (SIGTERM) and killed if it has not within
    ``stop_grace_s``: after a long replay moto can take longer to wind down its
    connections, and a bench must not lose its finished result to that."""
    import socket
    import subprocess
    import sys
    import urllib.request

    exe = Path(sys.executable).parent / "moto_server"
    if not exe.exists():
        raise SystemExit("moto_server not found; pip install 'moto[server]' or pass --endpoint")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{url}/moto-api/data.json", timeout=1).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("moto_server did not start") from None
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=stop_grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


# -- baselines ---------------------------------------------------------------------
async def _aio_round(endpoint: str | None, region: str | None, creds: dict[str, str],
                     bucket: str, keys: list[str], body: bytes, concurrency: int
                     ) -> tuple[float, float, float, float]:
    """(put seconds, get seconds, put CPU s per GB, get CPU s per GB) of a plain
    aiobotocore loop."""
    from aiobotocore.config import AioConfig
    from aiobotocore.session import get_session

    cfg = AioConfig(max_pool_connections=concurrency,
                    request_checksum_calculation="when_required",
                    response_checksum_validation="when_required")
    async with get_session().create_client("s3", endpoint_url=endpoint, region_name=region,
                                           config=cfg, **creds) as client:
        sem = asyncio.Semaphore(concurrency)

        async def put(k: str) -> None:
            async with sem:
                await client.put_object(Bucket=bucket, Key=k, Body=body)

        async def get(k: str) -> bytes:
            async with sem:
                r = await client.get_object(Bucket=bucket, Key=k)
                async with r["Body"] as s:
                    return bytes(await s.read())

        nbytes = len(keys) * len(body)
        t0, cpu = time.perf_counter(), CpuClock()
        await asyncio.gather(*(put(k) for k in keys))
        t1, put_cpu, cpu = time.perf_counter(), cpu.per_gb(nbytes), CpuClock()
        got = await asyncio.gather(*(get(k) for k in keys))
        t2, get_cpu = time.perf_counter(), cpu.per_gb(nbytes)
        assert all(len(g) == len(body) for g in got)
        return t1 - t0, t2 - t1, put_cpu, get_cpu


def _threads_round(endpoint: str | None, region: str | None, creds: dict[str, str],
                   bucket: str, keys: list[str], body: bytes, concurrency: int
                   ) -> tuple[float, float]:
    """(put seconds, get seconds) of boto3 on a thread pool (one request per thread)."""
    import boto3
    from botocore.config import Config

    client = boto3.client("s3", endpoint_url=endpoint, region_name=region,
                          config=Config(max_pool_connections=concurrency,
                                        request_checksum_calculation="when_required",
                                        response_checksum_validation="when_required"),
                          **creds)
    with ThreadPoolExecutor(concurrency) as pool:
        t0 = time.perf_counter()
        list(pool.map(lambda k: client.put_object(Bucket=bucket, Key=k, Body=body), keys))
        t1 = time.perf_counter()
        got = list(pool.map(
            lambda k: client.get_object(Bucket=bucket, Key=k)["Body"].read(), keys))
        t2 = time.perf_counter()
    assert all(len(g) == len(body) for g in got)
    return t1 - t0, t2 - t1


# -- the tier --------------------------------------------------------------------------
def _tier_round(cfg: dict[str, Any], blocks: int, block_bytes: int, seed: int
                ) -> tuple[float, float, float, dict[str, int], dict[str, float]]:
    """(store s, end-to-end load s, transfer-only load s, request counts, this
    process's CPU s per GB of each window) through vLLM's manager.

    The load is done twice from the same stored objects (the primary forgets
    them in between), once per window:

    * **end-to-end**: a new request's first lookup until every block is HIT,
      driven like vLLM's scheduler (:meth:`Harness.lookup_until_resolved`:
      every key looked up each step, a step every ~2 ms). It covers the
      lookup (answered by the presence index here: this engine stored the
      blocks, so no HEAD is sent -- ``HeadObject`` in the request counts
      shows it), promotion submission, the GETs, frame decode into the
      primary rows, and completion polling. The copy of the rows out of the
      primary (the stand-in for the CPU->GPU transfer) is outside it: the raw
      loop has nothing like it.
    * **transfer-only**: from the promotion job's submission (one step after
      the first lookup pass) until the tier's I/O pool is idle, without
      scheduler polling in between -- the same work as the raw GET loop
      (GET every object, land the bytes in memory) plus frame decode.
    """
    from vllm.v1.kv_offload.base import LookupResult

    from kvstore_tiers.admin.harness import build_harness, make_keys

    h = build_harness([cfg], num_chunks=blocks, chunk_bytes=block_bytes)
    try:
        keys = make_keys(blocks, seed=seed)
        rows = np.random.default_rng(seed).integers(0, 256, (blocks, block_bytes), np.uint8)
        nbytes = rows.nbytes
        cpu_per_gb: dict[str, float] = {}
        t0, cpu = time.perf_counter(), CpuClock()
        ctx = h.store(keys, rows)
        h.settle(timeout_s=600)
        t1, cpu_per_gb["tier_store"] = time.perf_counter(), cpu.per_gb(nbytes)
        h.finish_request(ctx)
        tier = h.tiers[0]
        assert tier.counters.objects_stored == blocks, tier.counters

        def check(results: list[Any], ctx: Any) -> None:
            assert results == [LookupResult.HIT] * blocks, results
            assert np.array_equal(h.load(keys, ctx), rows), "tier returned wrong bytes"
            h.finish_request(ctx)

        def end_to_end() -> float:
            # Lookup -> all HIT, polled like the scheduler.
            h.forget_primary()
            ctx = h.new_request()
            t, cpu = time.perf_counter(), CpuClock()
            results, _ = h.lookup_until_resolved(keys, ctx, timeout_s=300)
            t, cpu_per_gb["tier_load"] = time.perf_counter() - t, cpu.per_gb(nbytes)
            check(results, ctx)
            return t

        def transfer_only() -> float:
            # Submission -> pool idle, nobody polling meanwhile.
            h.forget_primary()
            ctx = h.new_request()
            with h.locked():
                first = [h.manager.lookup(k, ctx) for k in keys]
            assert LookupResult.HIT not in first, first
            t, cpu = time.perf_counter(), CpuClock()
            h.step()  # on_schedule_end: vLLM submits the batched promotion (submit_load)
            tier.pool.wait_idle()
            t, cpu_per_gb["tier_load_transfer"] = time.perf_counter() - t, cpu.per_gb(nbytes)
            results, _ = h.lookup_until_resolved(keys, ctx, timeout_s=300)
            check(results, ctx)
            return t

        # Alternate which window goes first, round by round.
        if seed % 2:
            xfer, e2e = transfer_only(), end_to_end()
        else:
            e2e, xfer = end_to_end(), transfer_only()
        return t1 - t0, e2e, xfer, dict(tier.backend.requests), cpu_per_gb
    finally:
        h.shutdown()


def _bytes_per_block(cfg: dict[str, Any], samples_dir: Path) -> dict[str, Any]:
    from kvstore_tiers.admin.harness import build_harness, make_keys

    out: dict[str, Any] = {}
    for entry, blocks in samples.load(samples_dir):
        n, row = blocks.shape
        res: dict[str, float] = {"raw": row}
        for comp in ("none", "kvsplit"):
            h = build_harness([{**cfg, "compression": comp,
                                "prefix": f"{cfg['prefix']}{comp}-{uuid.uuid4().hex[:8]}/"}],
                              num_chunks=n, chunk_bytes=row)
            try:
                ctx = h.store(make_keys(n, seed=7), blocks)
                h.settle(timeout_s=300)
                h.finish_request(ctx)
                res[comp] = h.tiers[0].counters.stored_bytes_written / n
            finally:
                h.shutdown()
        res["ratio"] = res["raw"] / res["kvsplit"]
        out[entry["file"]] = res
    return out


def _lookup_cost(cfg: dict[str, Any], n: int) -> dict[str, float]:
    from vllm.v1.kv_offload.base import LookupResult

    from kvstore_tiers.admin.harness import build_harness, make_keys

    row = 4096
    writer = build_harness([cfg], num_chunks=n, chunk_bytes=row)
    reader = build_harness([cfg], num_chunks=n, chunk_bytes=row)
    try:
        present, absent = make_keys(n, seed=101), make_keys(n, seed=202)
        ctx = writer.store(present, np.zeros((n, row), np.uint8))
        writer.settle()
        writer.finish_request(ctx)
        # The writer itself: answered from its presence index.
        writer.forget_primary()
        wb = writer.tiers[0].backend
        before_w = sum(wb.requests.values())
        wctx = writer.new_request()
        res, _ = writer.lookup_until_resolved(present, wctx, timeout_s=300)
        assert res == [LookupResult.HIT] * n
        writer_lookup_requests = sum(wb.requests.values()) - before_w - wb.requests["GetObject"]
        # Another engine: one existence request per block, hit or miss (a GET whose
        # body is held for the load while lookup_prefetch_bytes has room, else a HEAD).
        rb = reader.tiers[0].backend
        ctx = reader.new_request()
        before = rb.requests["HeadObject"] + rb.requests["GetObject"]
        res, _ = reader.lookup_until_resolved(present + absent, ctx, timeout_s=300)
        assert res[:n] == [LookupResult.HIT] * n or all(
            r in (LookupResult.HIT, LookupResult.MISS) for r in res)
        asked = rb.requests["HeadObject"] + rb.requests["GetObject"] - before
        return {
            "other_engine_requests_per_block": asked / (2 * n),
            "same_engine_requests_per_block": writer_lookup_requests / n,
        }
    finally:
        writer.shutdown()
        reader.shutdown()


def _empty_bucket(client: Any, bucket: str, prefix: str = "") -> None:
    paginator = client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
        objs = [{"Key": o["Key"]} for o in page.get("Contents", ())]
        if objs:
            client.delete_objects(Bucket=bucket, Delete={"Objects": objs, "Quiet": True})


def run(endpoint: str | None = None, bucket: str | None = None, blocks: int = 128,
        block_mib: float = 1.0, concurrency: int = 32, rounds: int = 3,
        samples_dir: Path | None = None, lookup_blocks: int = 64, prefix: str = "",
        region: str | None = None) -> dict[str, Any]:
    """Run every measurement; return the numbers.

    ``bucket`` None: a local moto_server and a fresh bucket on it (``endpoint``
    ignored). Otherwise the user's ``bucket`` at ``endpoint`` (None: AWS) in
    ``region``, credentials from the AWS chain, objects only under ``prefix``
    (emptied afterwards). ``samples_dir``: real KV samples for bytes per
    block (skipped if None).
    """
    import boto3

    with contextlib.ExitStack() as stack:
        if bucket is None:
            endpoint = stack.enter_context(moto_server())
            server = "moto_server (local, in-memory)"
            creds: dict[str, str] = dict(FAKE_KEYS)
            region = "us-east-1"
        else:
            server = f"{endpoint or 'AWS S3'}, bucket {bucket}"
            creds = {}  # the AWS chain: environment, shared config/profile, role
        admin = boto3.client("s3", endpoint_url=endpoint, region_name=region, **creds)
        if bucket is None:
            bucket = f"kvbench-{uuid.uuid4().hex[:12]}"
            admin.create_bucket(Bucket=bucket)
        root = f"{prefix}kvstore-bench-{uuid.uuid4().hex[:8]}/"
        stack.callback(_empty_bucket, admin, bucket, root)
        block_bytes = int(block_mib * MiB)
        total = blocks * block_bytes
        body = os.urandom(block_bytes)
        base_cfg: dict[str, Any] = {
            "type": "s3", "bucket": bucket, "endpoint_url": endpoint, **creds,
            "max_concurrency": concurrency,
        }
        if region:
            base_cfg["region"] = region
        times: dict[str, list[float]] = {k: [] for k in (
            "tier_store", "tier_load", "tier_load_transfer", "aio_put", "aio_get",
            "threads_put", "threads_get")}
        ratios: dict[str, list[float]] = {"store": [], "load": [], "load_transfer": []}
        cpu: dict[str, list[float]] = {k: [] for k in (
            "tier_store", "tier_load", "tier_load_transfer", "aio_put", "aio_get")}
        requests: dict[str, int] = {}
        for r in range(rounds):
            rp = f"{root}round-{r}/"
            s, lo, lx, requests, tier_cpu = _tier_round(
                {**base_cfg, "prefix": rp + "tier/", "compression": "none"}, blocks,
                block_bytes, r)
            for k, v in tier_cpu.items():
                cpu[k].append(v)
            times["tier_store"].append(s)
            times["tier_load"].append(lo)
            times["tier_load_transfer"].append(lx)
            keys = [f"{rp}aio/{i:06d}.kvf" for i in range(blocks)]
            p, g, put_cpu, get_cpu = asyncio.run(_aio_round(endpoint, region, creds, bucket,
                                                            keys, body, concurrency))
            cpu["aio_put"].append(put_cpu)
            cpu["aio_get"].append(get_cpu)
            times["aio_put"].append(p)
            times["aio_get"].append(g)
            # Per-round ratios (tier and raw loop back to back): less noisy than
            # a ratio of medians when other jobs share the machine.
            ratios["store"].append(p / s)
            ratios["load"].append(g / lo)
            ratios["load_transfer"].append(g / lx)
            keys = [f"{rp}thr/{i:06d}.kvf" for i in range(blocks)]
            p, g = _threads_round(endpoint, region, creds, bucket, keys, body, concurrency)
            times["threads_put"].append(p)
            times["threads_get"].append(g)
            _empty_bucket(admin, bucket, rp)  # keep an in-memory server small
        med = {k: statistics.median(v) for k, v in times.items()}
        gb = {k: _gbps(total, v) for k, v in med.items()}
        result: dict[str, Any] = {
            "server": server,
            "blocks": blocks, "block_bytes": block_bytes, "concurrency": concurrency,
            "rounds": rounds,
            "gbps": gb,
            #: This process's CPU seconds per GB, median of rounds (moto's not counted).
            "cpu_s_per_gb": {k: statistics.median(v) for k, v in cpu.items()},
            "tier_vs_raw_aio": {"store": gb["tier_store"] / gb["aio_put"],
                                "load": gb["tier_load"] / gb["aio_get"],
                                "load_transfer": gb["tier_load_transfer"] / gb["aio_get"]},
            "tier_vs_raw_aio_median_of_rounds": {
                k: statistics.median(v) for k, v in ratios.items()},
            "aio_vs_threads": {"put": gb["aio_put"] / gb["threads_put"],
                               "get": gb["aio_get"] / gb["threads_get"]},
            "tier_requests_last_round": requests,
        }
        result["lookup"] = _lookup_cost({**base_cfg, "prefix": f"{root}lookup/"}, lookup_blocks)
        if samples_dir is not None:
            result["bytes_per_block"] = _bytes_per_block(
                {**base_cfg, "prefix": f"{root}bytes/"}, samples_dir)
        return result
