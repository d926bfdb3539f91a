"""The remote tiers at network distance: a tier's load of a prefix against the
protocol's bound and a raw client, at each round-trip time and under a bandwidth cap.

Run by ``kvstore-tiers bench --distance``. For each of s3 and redis (its own
moto_server / redis-server, or the user's ``--s3-*`` endpoint / ``--redis-url``),
``total_mib`` of incompressible blocks are stored once through the tier on
loopback; then, for every cell (an RTT, and one RTT with a bandwidth cap), a
delaying proxy (:mod:`kvstore_tiers.tools.netem.delay`) is put in front of the
server, behind a capped veth pair (:mod:`kvstore_tiers.tools.netem.link`) for the
capped cell, and through it, in alternating order:

* **raw**: a plain client of the same concurrency GETs every stored object
  (aiobotocore, ``max_concurrency`` requests in flight; redis-py,
  ``n_read_threads`` connections with pipelines of ``pipeline_batch``), on
  connections it already opened (its second pass is timed);
* **tier, first load**: a fresh engine (vLLM's real manager through
  :mod:`kvstore_tiers.admin.harness`, built at distance, so its start-up is
  not timed) looks the prefix up until every block is HIT: existence checks
  (HEAD / EXISTS), the GETs, the frames decoded into primary rows;
* **tier, again**: the same engine after the primary forgot the blocks (its
  presence index answers, so GETs only).

The **bound** of each is ``rtts x RTT + bytes / bandwidth``: ``rtts`` is the
round trips the protocol needs at that concurrency (s3: ``ceil(N / C)`` waves of
GET, as many of HEAD first on a fresh engine unless its existence checks GET the
whole prefix (``lookup_prefetch_bytes``), each wave two RTTs on a server
that closes its connections after every answer, as moto's does; redis:
``ceil(N / (batch x threads))`` waves of pipelined GETs, one pipeline of EXISTS
first), and the bandwidth is the cap where there is one, else the fastest of the
three at the lowest RTT in this run (the machine's own ceiling through the
proxy). ``x bound`` is measured / bound: 1.2 or less is the target. ``first: +
RTTs`` is what the RTT added to a fresh engine's load against RTT 0, in RTTs
(for a small prefix: the tier's part of a fresh engine's first prompt at that
distance). Each cell also notes the p99 of the scheduler thread's lookup calls
during the loads and the time its store submission took (16 blocks, stored at
that distance): neither may grow with the RTT. Once its harness is built, the bench
freezes its start-up heap out of the garbage collector, as vLLM's EngineCore does once
started (a full collection of an unfrozen heap stops every thread for about half a
second here).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from kvstore_tiers.tools.netem import capability, link
from kvstore_tiers.tools.netem.delay import delay_proxy

MiB = 1 << 20


@dataclass
class DistancePlan:
    """What one ``bench --distance`` run measures."""

    tiers: tuple[str, ...] = ("s3", "redis")
    rtts_ms: tuple[float, ...] = (0, 1, 5, 20, 50)
    #: The capped cell's rate (None: no capped cell) and RTT.
    cap_mbit: float | None = 400.0
    cap_rtt_ms: float = 20.0
    total_mib: int = 100
    block_kib: int = 1024
    rounds: int = 1
    #: Tier keys set on every measured tier (e.g. max_concurrency), as --tier-key gives them.
    tier_keys: dict[str, Any] = field(default_factory=dict)
    s3_bucket: str | None = None
    s3_endpoint: str | None = None
    s3_prefix: str = ""
    s3_region: str | None = None
    redis_url: str | None = field(default=None, repr=False)

    def cells(self) -> list[tuple[float, float | None]]:
        """(RTT ms, cap Mbit/s or None) of every cell, the capped one last."""
        out: list[tuple[float, float | None]] = [(r, None) for r in self.rtts_ms]
        if self.cap_mbit:
            out.append((self.cap_rtt_ms, self.cap_mbit))
        return out


def _with_netloc(url: str, host: str, port: int) -> str:
    """``url`` pointing at ``host:port``, its scheme, credentials, path and query kept."""
    parts = urlsplit(url)
    auth = parts.netloc.rpartition("@")[0]
    return urlunsplit(parts._replace(netloc=f"{auth + '@' if auth else ''}{host}:{port}"))


def _upstream(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme in ("https", "rediss"):
        raise SystemExit(f"--distance puts a plain TCP proxy in front of the server: "
                         f"{parts.scheme}:// would fail its certificate check; use http/redis")
    default = {"http": 80, "redis": 6379}.get(parts.scheme, 0)
    return parts.hostname or "127.0.0.1", parts.port or default


class _Side:
    """One remote tier under test: its server, its stored prefix, its raw client."""

    name = ""
    url = ""

    def tier_config(self, url: str) -> dict[str, Any]:
        raise NotImplementedError

    def raw_load(self, url: str) -> tuple[float, int]:
        raise NotImplementedError

    def rtts(self, blocks: int, fresh: bool) -> int:
        raise NotImplementedError


class _S3(_Side):
    name = "s3"

    def __init__(self, plan: DistancePlan, stack: contextlib.ExitStack) -> None:
        import boto3

        from kvstore_tiers.backends.s3.config import S3Config
        from kvstore_tiers.tools.bench import s3_bench

        if plan.s3_bucket is None:
            self.url = stack.enter_context(s3_bench.moto_server())
            self.creds: dict[str, str] = dict(s3_bench.FAKE_KEYS)
            self.region: str | None = "us-east-1"
            self.bucket = f"kvdist-{uuid.uuid4().hex[:12]}"
            self.server = "moto_server (local)"
        else:
            if not plan.s3_endpoint:
                raise SystemExit("--distance needs --s3-endpoint with --s3-bucket (an "
                                 "http:// endpoint the proxy can stand in front of)")
            self.url, self.creds, self.region = plan.s3_endpoint, {}, plan.s3_region
            self.bucket, self.server = plan.s3_bucket, f"{plan.s3_endpoint}"
        admin = boto3.client("s3", endpoint_url=self.url, region_name=self.region, **self.creds)
        if plan.s3_bucket is None:
            admin.create_bucket(Bucket=self.bucket)
        # Known before any load, so a table that starts with a fresh engine can say it.
        with contextlib.suppress(Exception):
            head = admin.head_bucket(Bucket=self.bucket)
            self.closes = head["ResponseMetadata"]["HTTPHeaders"].get("connection") == "close"
        self.prefix = f"{plan.s3_prefix}kvstore-distance-{uuid.uuid4().hex[:8]}/"
        stack.callback(s3_bench._empty_bucket, admin, self.bucket, self.prefix)
        self.keys_extra = plan.tier_keys
        self.concurrency = int(plan.tier_keys.get(
            "max_concurrency", S3Config.model_fields["max_concurrency"].default))
        self.prefetches = self.prefetch_covers(plan)

    def tier_config(self, url: str) -> dict[str, Any]:
        cfg = {"type": "s3", "bucket": self.bucket, "endpoint_url": url, "prefix": self.prefix,
               "compression": "none", **self.creds, **self.keys_extra}
        if self.region:
            cfg["region"] = self.region
        return cfg

    def raw_load(self, url: str) -> tuple[float, int]:
        return asyncio.run(self._raw(url))

    async def _raw(self, url: str) -> tuple[float, int]:
        from aiobotocore.config import AioConfig
        from aiobotocore.session import get_session

        cfg = AioConfig(max_pool_connections=self.concurrency,
                        request_checksum_calculation="when_required",
                        response_checksum_validation="when_required")
        async with get_session().create_client("s3", endpoint_url=url, region_name=self.region,
                                               config=cfg, **self.creds) as client:
            sem = asyncio.Semaphore(self.concurrency)

            async def get(k: str) -> int:
                async with sem:
                    r = await client.get_object(Bucket=self.bucket, Key=k)
                    if r["ResponseMetadata"]["HTTPHeaders"].get("connection") == "close":
                        self.closes = True
                    async with r["Body"] as s:
                        return len(await s.read())

            async def everything() -> tuple[float, int]:
                t0 = time.perf_counter()
                got = sum(await asyncio.gather(*(get(k) for k in self.object_keys)))
                return time.perf_counter() - t0, got

            await everything()  # opens the connections: the timed pass runs on them
            return await everything()

    @staticmethod
    def prefetch_covers(plan: DistancePlan) -> bool:
        """Whether a fresh engine's existence checks GET (and hold) the whole prefix
        (``lookup_prefetch_bytes``): then its load needs no HEAD wave."""
        from kvstore_tiers.backends.s3.config import S3Config

        budget = int(plan.tier_keys.get(
            "lookup_prefetch_bytes", S3Config.model_fields["lookup_prefetch_bytes"].default))
        return budget >= plan.total_mib * MiB * 1.01  # each frame's header on top of its row

    #: The server closes every connection after its answer (moto's does), so every
    #: request pays a TCP handshake: two RTTs a wave, not one.
    closes = False

    def rtts(self, blocks: int, fresh: bool) -> int:
        waves = math.ceil(blocks / self.concurrency) * (2 if self.closes else 1)
        return waves * (2 if fresh and not self.prefetches else 1)


class _Redis(_Side):
    name = "redis"

    def __init__(self, plan: DistancePlan, stack: contextlib.ExitStack) -> None:
        from kvstore_tiers.backends.redis.config import RedisConfig
        from kvstore_tiers.config import TierConfig
        from kvstore_tiers.tools.bench import redis_bench

        if plan.redis_url is None:
            port = stack.enter_context(redis_bench.redis_server())
            self.url, self.server = f"redis://127.0.0.1:{port}/0", "redis-server (local)"
        else:
            self.url, self.server = plan.redis_url, redis_bench.server_label(plan.redis_url)
        self.prefix = f"kvstore-distance-{uuid.uuid4().hex[:8]}:"
        self.keys_extra = plan.tier_keys
        self.threads = int(plan.tier_keys.get(
            "n_read_threads", TierConfig.model_fields["n_read_threads"].default))
        self.batch = int(plan.tier_keys.get(
            "pipeline_batch", RedisConfig.model_fields["pipeline_batch"].default))

        def cleanup() -> None:
            import redis

            client = redis.Redis.from_url(self.url)
            redis_bench._delete_prefix(client, self.prefix)
            client.close()

        stack.callback(cleanup)

    def tier_config(self, url: str) -> dict[str, Any]:
        return {"type": "redis", "url": url, "key_prefix": self.prefix, "compression": "none",
                **self.keys_extra}

    def raw_load(self, url: str) -> tuple[float, int]:
        import redis

        pool = redis.ConnectionPool.from_url(url, max_connections=self.threads)
        client = redis.Redis(connection_pool=pool)
        keys = self.object_keys
        batches = [keys[i:i + self.batch] for i in range(0, len(keys), self.batch)]

        def work(batch: list[str]) -> int:
            pipe = client.pipeline(transaction=False)
            for k in batch:
                pipe.get(k)
            return sum(len(v) for v in pipe.execute() if v is not None)

        try:
            with ThreadPoolExecutor(self.threads) as ex:
                list(ex.map(lambda _: client.ping(), range(self.threads)))  # open them
                t0 = time.perf_counter()
                got = sum(ex.map(work, batches))
                return time.perf_counter() - t0, got
        finally:
            pool.disconnect()

    def rtts(self, blocks: int, fresh: bool) -> int:
        return math.ceil(blocks / (self.batch * self.threads)) + (1 if fresh else 0)


def _store(side: _Side, keys: list[bytes], rows: np.ndarray) -> None:
    """Store the prefix once, on loopback; note each block's object key on ``side``."""
    from kvstore_tiers.admin.harness import build_harness

    h = build_harness([side.tier_config(side.url)], num_chunks=len(keys),
                      chunk_bytes=rows.shape[1])
    try:
        ctx = h.store(keys, rows)
        h.settle(timeout_s=600)
        h.finish_request(ctx)
        tier = h.tiers[0]
        assert tier.counters.objects_stored == len(keys), tier.counters
        backend = tier.backend
        name = tier.namespace.object_name
        side.object_keys = [backend.key(name(k)) if side.name == "redis"
                            else backend.prefix + name(k) for k in keys]
    finally:
        h.shutdown()


def _tier_load(side: _Side, url: str, keys: list[bytes], rows: np.ndarray
               ) -> dict[str, float]:
    """A fresh engine built against ``url``: ``first`` and ``again`` load seconds, the
    p99 of its scheduler-thread lookup calls meanwhile (``lookup_p99_us``), and the
    seconds its scheduler thread spent submitting a store of 16 new blocks
    (``store_submit_ms``: the store goes out at distance, the call must not wait)."""
    from vllm.utils.gc_utils import freeze_gc_heap
    from vllm.v1.kv_offload.base import LookupResult

    from kvstore_tiers.admin.harness import build_harness, make_keys

    h = build_harness([side.tier_config(url)], num_chunks=len(keys), chunk_bytes=rows.shape[1])
    # As vLLM's EngineCore does once started: what start-up allocated (vLLM's and
    # torch's modules, the harness) leaves the collector's generations. Unfrozen, a
    # full collection of this process's heap holds the GIL for about half a second,
    # and the tier's event loop with it, in the middle of whichever load it hits.
    freeze_gc_heap()
    calls: list[float] = []
    try:
        def once() -> float:
            h.forget_primary()
            ctx = h.new_request()
            t0 = time.perf_counter()
            while True:
                with h.locked():
                    results = []
                    for k in keys:
                        t = time.perf_counter()
                        results.append(h.manager.lookup(k, ctx))
                        calls.append(time.perf_counter() - t)
                if all(r in (LookupResult.HIT, LookupResult.MISS) for r in results):
                    break
                if time.perf_counter() - t0 > 600:
                    raise TimeoutError(f"lookups unresolved after 600 s: {results}")
                h.step()
                time.sleep(0.002)
            dt = time.perf_counter() - t0
            assert results == [LookupResult.HIT] * len(keys), results
            assert np.array_equal(h.load(keys, ctx), rows), "tier returned wrong bytes"
            h.finish_request(ctx)
            return dt

        out = {"first": once(), "again": once(),
               "lookup_p99_us": float(np.percentile(calls, 99)) * 1e6}
        h.forget_primary()
        new = make_keys(16, seed=len(calls))
        t0 = time.perf_counter()
        ctx = h.store(new, rows[:16])
        out["store_submit_ms"] = (time.perf_counter() - t0) * 1e3
        h.settle(timeout_s=600)
        h.finish_request(ctx)
        return out
    finally:
        h.shutdown()
        gc.unfreeze()


@contextlib.contextmanager
def _path(upstream: tuple[str, int], rtt_ms: float, cap_mbit: float | None
          ) -> Iterator[tuple[str, int]]:
    """A proxy adding ``rtt_ms``, behind a link capped at ``cap_mbit`` when given."""
    with contextlib.ExitStack() as stack:
        netns, host = None, "127.0.0.1"
        if cap_mbit:
            capped = stack.enter_context(link.CappedLink(cap_mbit))
            netns, host = capped.netns, capped.inner
        yield stack.enter_context(delay_proxy(upstream, rtt_ms, host=host, netns=netns))


@contextlib.contextmanager
def at_distance(url: str, rtt_ms: float, cap_mbit: float | None = None) -> Iterator[str]:
    """``url`` (http:// or redis://) reached through a delaying proxy adding ``rtt_ms``
    (behind a link capped at ``cap_mbit`` when given): yields the proxied URL, its
    scheme, credentials, path and query kept; the proxy stops on exit."""
    with _path(_upstream(url), rtt_ms, cap_mbit) as (host, port):
        yield _with_netloc(url, host, port)


#: The remote tiers this module can put at a distance, by tier type.
SIDES: dict[str, type[_Side]] = {"s3": _S3, "redis": _Redis}


def remote(name: str, plan: DistancePlan, stack: contextlib.ExitStack) -> _Side:
    """Tier ``name``'s server (its own, or the one ``plan`` names), ready for
    ``tier_config(url)``; what it stored is removed when ``stack`` closes."""
    return SIDES[name](plan, stack)


def run(plan: DistancePlan, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Every cell of every tier; returns ``{"plan", "tiers": {name: {"server", "bytes",
    "blocks", "cells": [...]}}}``, each cell with its times, bounds and ratios."""
    from kvstore_tiers.admin.harness import make_keys, rows_for

    if plan.cap_mbit and (why := capability.unavailable()):
        progress(f"distance: no capped cell ({why})")
        plan.cap_mbit = None
    block = plan.block_kib << 10
    blocks = max(1, (plan.total_mib * MiB) // block)
    keys = make_keys(blocks, seed=52)
    rows = rows_for(keys, block)
    out: dict[str, Any] = {"plan": {k: v for k, v in plan.__dict__.items()
                                    if k not in ("redis_url",)}, "tiers": {}}
    for name in plan.tiers:
        with contextlib.ExitStack() as stack:
            side = remote(name, plan, stack)
            progress(f"{name}: storing {blocks} blocks of {plan.block_kib} KiB on loopback")
            _store(side, keys, rows)
            cells = []
            for rtt, cap in plan.cells():
                label = f"{name}: RTT {rtt:g} ms" + (f", {cap:g} Mbit/s" if cap else "")
                progress(label)
                samples: dict[str, list[float]] = {"raw": [], "first": [], "again": [],
                                                   "lookup_p99_us": [], "store_submit_ms": []}
                nbytes = 0
                for r in range(plan.rounds):
                    with at_distance(side.url, rtt, cap) as url:
                        order = ("raw", "tier") if r % 2 == 0 else ("tier", "raw")
                        for what in order:
                            if what == "raw":
                                dt, nbytes = side.raw_load(url)
                                samples["raw"].append(dt)
                            else:
                                for k, v in _tier_load(side, url, keys, rows).items():
                                    samples[k].append(v)
                cells.append({"rtt_ms": rtt, "cap_mbit": cap, "bytes": nbytes,
                              **{k: statistics.median(v) for k, v in samples.items()}})
            out["tiers"][name] = {"server": side.server, "blocks": blocks, "block_bytes": block,
                                  "closes_connections": getattr(side, "closes", False),
                                  "rtts": {"raw": side.rtts(blocks, False),
                                           "first": side.rtts(blocks, True),
                                           "again": side.rtts(blocks, False)},
                                  "cells": bounds(cells, side, blocks)}
    return out


def bounds(cells: list[dict[str, Any]], side: _Side | None, blocks: int,
           rtts: dict[str, int] | None = None) -> list[dict[str, Any]]:
    """Each cell with ``bound_<what>`` (s) and ``x_<what>`` (measured / bound) added.

    The bandwidth of an uncapped cell is the fastest any of raw, first and again moved the
    bytes at the lowest uncapped RTT (this machine's ceiling through the proxy)."""
    if rtts is None:
        assert side is not None
        rtts = {"raw": side.rtts(blocks, False), "first": side.rtts(blocks, True),
                "again": side.rtts(blocks, False)}
    free = [c for c in cells if not c["cap_mbit"]]
    base = min(free, key=lambda c: c["rtt_ms"]) if free else None
    for c in cells:
        bw = c["cap_mbit"] * 1e6 / 8 if c["cap_mbit"] else (
            base["bytes"] / min(base[w] for w in rtts) if base else float("inf"))
        c["bandwidth_Bps"] = bw
        for what, n in rtts.items():
            c[f"bound_{what}"] = n * c["rtt_ms"] / 1e3 + c["bytes"] / bw
            c[f"x_{what}"] = c[what] / c[f"bound_{what}"]
        # What distance added to a fresh engine's load, in RTTs (a first prompt's cost).
        far = base is not None and c is not base and c["rtt_ms"] > 0 and not c["cap_mbit"]
        c["first_extra_rtts"] = ((c["first"] - base["first"]) / (c["rtt_ms"] / 1e3)
                                 if far and base is not None else None)
    return cells


def table(result: dict[str, Any]) -> Any:
    """The distance table: per tier and cell, seconds and x bound of raw, first, again."""
    from rich.table import Table

    t = Table(title="remote tiers at distance: load of a prefix, seconds (x bound: "
              "measured / (RTTs x RTT + bytes / bandwidth))")
    for col in ("tier", "RTT ms", "cap Mbit/s", "MB", "raw GET", "tier first load",
                "tier again", "RTTs raw/first/again", "first: + RTTs", "lookup p99 us",
                "store submit ms"):
        t.add_column(col, justify="left" if col == "tier" else "right")
    for name, res in result["tiers"].items():
        r = res["rtts"]
        server = res["server"] + (", closes connections" if res["closes_connections"] else "")
        for c in res["cells"]:
            t.add_row(f"{name} ({server})", f"{c['rtt_ms']:g}",
                      f"{c['cap_mbit']:g}" if c["cap_mbit"] else "-", f"{c['bytes'] / 1e6:.0f}",
                      *(f"{c[w]:.3f} ({c[f'x_{w}']:.2f}x)" for w in ("raw", "first", "again")),
                      f"{r['raw']}/{r['first']}/{r['again']}",
                      "-" if c.get("first_extra_rtts") is None else f"{c['first_extra_rtts']:.1f}",
                      f"{c['lookup_p99_us']:.0f}",
                      f"{c['store_submit_ms']:.2f}")
    return t
