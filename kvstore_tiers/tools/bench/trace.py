"""Write economics: a request trace replayed through vLLM's real tiering manager.

Run by ``kvstore-tiers bench --trace PATH``. For every (tier, policy,
capacity) it builds vLLM's real ``TieringOffloadingManager`` with one real
secondary tier (:mod:`kvstore_tiers.admin.harness`, as an engine builds it)
and drives it as vLLM's scheduler does, one request after another, as fast
as the tier allows (the trace's timestamps are not replayed):

0. **Wait** until the earlier requests' cascades have reached the tier
   (their rows stay pinned in the small primary until then: a promotion
   finding no free row would be a MISS that an engine with a CPU tier of
   gigabytes never sees). Loads therefore run beside no earlier store.
1. **Lookup**, as ``OffloadingConnectorScheduler._maximal_prefix_lookup``:
   every block in order until the first MISS; HIT_PENDING (a promotion from
   the tier under way) and RETRY (an existence check under way) defer the
   request, which looks up again after a scheduler step
   (``on_schedule_end`` submits the batched promotion, finished jobs are
   polled), until no block defers.
2. **Load** the leading hits (``prepare_load``/``complete_load``); a hit
   counts for the tier when vLLM's ``get_load_source`` names the tier (it
   was promoted from it), else for the primary.
3. **Store** the rest of the prompt's blocks (the computed ones):
   ``prepare_store`` in pieces of :data:`STORE_PIECE` blocks (a prefill step
   of 8,192 tokens), the rows filled with real KV bytes, ``complete_store``
   (vLLM cascades them to the tier), a scheduler step after each piece. When
   the primary has no free row (its rows are pinned by cascades in flight)
   the store waits for the tier: steps until ``prepare_store`` succeeds.
4. **Finish** the request; one more step.

Block ids map to deterministic 36-byte OffloadKeys; one trace block (512
tokens) is one offload chunk of ``chunk_bytes`` (a small real chunk so a run
takes minutes; byte counts are reported as measured and scaled to a stated
model's bytes per 512 tokens). The primary (CPU) tier holds a few requests'
worth of blocks, so hits are mostly the tier's: the tier is what is measured.

Capacities are shares of the replayed prefix's distinct blocks: fs gets
``max_bytes`` (its evictor, :mod:`kvstore_tiers.backends.fs.capacity`), redis
a ``maxmemory`` with ``allkeys-lru`` (a redis-server started here), s3 (a
moto server started here) has no capacity and runs at 100 %. Beside each
run, the plain LRU replay of :mod:`.trace_reference` at the same capacity.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvstore_tiers.tools.bench import trace_reference
from kvstore_tiers.tools.bench.trace_file import BLOCK_TOKENS, TraceRequest, distinct_blocks

#: Blocks per ``prepare_store`` (a prefill step of 8,192 tokens of 512-token blocks).
STORE_PIECE = 16
#: Admission policies ``--policy`` accepts (the tier's ``admission`` key).
POLICIES = ("always", "reuse", "adaptive")
TIERS = ("fs", "redis", "s3")
#: Realistic bytes per 512-token block the measured counts are scaled to:
#: layers x 2 (K, V) x kv_heads x head_dim x 2 bytes (bf16) x 512 tokens.
SCALES = {
    "SmolLM2-135M": 30 * 2 * 3 * 64 * 2 * BLOCK_TOKENS,  # 11.25 MiB
    "Llama-3.1-8B": 32 * 2 * 8 * 128 * 2 * BLOCK_TOKENS,  # 64 MiB
}
_GROUP = (0).to_bytes(4, "big")
#: vLLM's latency backpressure for the remote tiers, set out of reach: its
#: water marks are seconds per MiB tuned for MiB-size chunks, and with the
#: small chunks of a replay a job's fixed round-trip time alone crosses them,
#: so it would skip most cascades, for a reason a real chunk would not have.
REMOTE_BACKPRESSURE = {"backpressure_cls": "EMABackpressureDetector",
                       "high_water_s": 1e6, "low_water_s": 1e6}
#: Every tier of the replay: no bound on the store bytes in flight. Its default
#: is half the primary, sized for an engine's CPU tier of gigabytes; against the
#: replay's primary of a few requests it would drop stores the bench must count.
TIER_KEYS = {"max_store_bytes_in_flight": 0}
#: The fs tier's (high, low) watermarks in the replay. Each eviction round
#: re-counts the whole namespace directory (4,096 shard directories): with the
#: default band (0.95-0.85) a 2 % capacity takes ~650 rounds per 3,000
#: requests, half a second each on the 2-core VM; a wider band evicts in
#: fewer, larger rounds.
FS_WATERMARKS = (0.95, 0.5)


def fs_watermarks(tier_keys: dict[str, Any]) -> tuple[float, float]:
    """The fs tier's (high, low) watermarks in the replay: :data:`FS_WATERMARKS`,
    or those given as tier keys (``--tier-key low_watermark=0.85``), taken as
    the fs tier takes them (:attr:`FsConfig.watermarks`); a bad one raises
    :class:`ConfigError` naming the key."""
    from kvstore_tiers.backends.fs.config import FsConfig
    from kvstore_tiers.config import validate_config

    keys = {k: tier_keys.get(k, default)
            for k, default in zip(("high_watermark", "low_watermark"), FS_WATERMARKS,
                                  strict=True)}
    return validate_config(FsConfig, "fs", {"root_dir": ".", **keys}).watermarks


def block_key(block_id: int) -> bytes:
    """The OffloadKey of trace block ``block_id``: 32-byte hash + group index 0."""
    return hashlib.sha256(b"trace-block:%d" % block_id).digest() + _GROUP


def payload_rows(chunk_bytes: int, samples_dir: Path | None) -> np.ndarray:
    """Rows of ``chunk_bytes`` to store: real bf16 KV cut from the samples when
    given (so compression behaves as on real KV), else random bytes."""
    if samples_dir is not None:
        from kvstore_tiers.tools import samples

        raw = np.concatenate([blocks.reshape(-1) for _, blocks in samples.load(samples_dir)])
        n = len(raw) // chunk_bytes
        if n >= 1:
            return raw[: n * chunk_bytes].reshape(n, chunk_bytes).copy()
    return np.random.default_rng(0).integers(0, 256, (64, chunk_bytes), np.uint8)


@dataclass
class ReplayStats:
    """What one real-manager replay counted (the tier's own counters come beside it)."""

    requests: int = 0
    blocks_requested: int = 0
    tokens_requested: int = 0
    blocks_hit: int = 0  # leading HITs, primary and tier
    tokens_hit: int = 0
    tier_blocks_hit: int = 0  # of those, promoted from the tier
    tier_tokens_hit: int = 0
    blocks_cascaded: int = 0  # newly stored in the primary (vLLM cascades each to the tier)
    lookup_passes: int = 0
    store_waits: int = 0  # steps a store waited for a free primary row
    load_wait_s: float = 0.0  # lookup start -> resolved, requests with tier hits
    seconds: float = 0.0


class Replayer:
    """Drives one :class:`~kvstore_tiers.admin.harness.Harness` through a trace."""

    def __init__(self, harness: Any, rows: np.ndarray, step_sleep_s: float = 0.0005) -> None:
        from vllm.v1.kv_offload.base import LookupResult

        self.h = harness
        self.m = harness.manager
        self.tier = harness.tiers[0]
        self.rows = rows
        self.view = harness.view
        self.sleep = step_sleep_s
        self.stats = ReplayStats()
        self._hit, self._pending, self._retry = (
            LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.RETRY)
        self._miss = LookupResult.MISS

    def close(self) -> None:
        """Drop the view of the primary's rows: vLLM's shutdown closes its mmap,
        which fails while a view of it is alive."""
        self.view = np.empty((0, 0), np.uint8)

    def _prefix_lookup(self, keys: Sequence[bytes], ctx: Any) -> int | None:
        """Leading hits, or None while a block is being promoted or checked
        (vLLM's ``_maximal_prefix_lookup``)."""
        hits, defer = 0, False
        for k in keys:
            r = self.m.lookup(k, ctx)
            if r is self._hit:
                hits += 1
            elif r is self._pending:
                defer, hits = True, hits + 1
            elif r is self._retry:
                defer = True
            else:
                break
        return None if defer else hits

    def request(self, req: TraceRequest, timeout_s: float = 120.0) -> None:
        """Replay one request: lookup, load, store the rest, finish."""
        h, m, st = self.h, self.m, self.stats
        keys = [block_key(b) for b in req.hash_ids]
        # The earlier requests' cascades reach the tier first: their rows are pinned
        # in the small primary until then, and a promotion that finds no free row
        # is a MISS (vLLM's promotion allocation failure), a loss an engine with a
        # CPU tier of gigabytes would not see. This also makes a replay deterministic.
        h.settle(timeout_s)
        ctx = h.new_request()
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        while True:
            st.lookup_passes += 1
            with h.locked():
                hits = self._prefix_lookup(keys, ctx)
            if hits is not None:
                break
            h.step()
            if time.monotonic() > deadline:
                raise TimeoutError(f"request {st.requests}: lookups unresolved")
            time.sleep(self.sleep)
        waited = time.perf_counter() - t0
        st.requests += 1
        st.blocks_requested += len(keys)
        st.tokens_requested += req.input_length
        if hits:
            src = self.tier.cache_hit_source
            with h.locked():
                sources = [m.get_load_source(k, ctx) for k in keys[:hits]]
                m.prepare_load(keys[:hits], ctx)
                m.complete_load(keys[:hits], ctx)
            from_tier = [i for i, s in enumerate(sources) if s == src]
            self._hit_sources(keys[:hits], sources)
            st.blocks_hit += hits
            st.tokens_hit += sum(req.block_tokens(i) for i in range(hits))
            if from_tier:
                st.tier_blocks_hit += len(from_tier)
                st.tier_tokens_hit += sum(req.block_tokens(i) for i in from_tier)
                st.load_wait_s += waited
        rest = list(range(hits, len(keys)))
        for p in range(0, len(rest), STORE_PIECE):
            self._store([keys[i] for i in rest[p:p + STORE_PIECE]],
                        [req.hash_ids[i] for i in rest[p:p + STORE_PIECE]], ctx, deadline)
        h.finish_request(ctx)
        h.step()

    def _hit_sources(self, keys: list[bytes], sources: list[Any]) -> None:
        """Told of a request's leading hits and vLLM's ``get_load_source`` of each."""

    def _store(self, keys: list[bytes], ids: list[int], ctx: Any, deadline: float) -> None:
        h, m = self.h, self.m
        by_key = dict(zip(keys, ids, strict=True))
        while True:
            with h.locked():
                out = m.prepare_store(keys, ctx)
                if out is not None:
                    stored = list(out.keys_to_store)
                    if stored:  # all already in the primary: nothing to complete (as vLLM)
                        n = len(self.rows)
                        for cid, k in zip(np.asarray(out.store_spec.chunk_ids), stored,
                                          strict=True):
                            self.view[int(cid)] = self.rows[by_key[k] % n]
                        m.complete_store(stored, ctx)
                        self.stats.blocks_cascaded += len(stored)
                    break
            # Every primary row is pinned by a cascade in flight: wait for the tier.
            self.stats.store_waits += 1
            if time.monotonic() > deadline:
                raise TimeoutError("the primary tier stayed full")
            h.step()
            time.sleep(self.sleep)
        h.step()


def replay(requests: Sequence[TraceRequest], tier_cfg: dict[str, Any], chunk_bytes: int,
           primary_blocks: int, rows: np.ndarray,
           inspect: Callable[[Any], dict[str, Any]] | None = None
           ) -> tuple[ReplayStats, dict[str, Any]]:
    """Replay ``requests`` through vLLM's manager with the tier ``tier_cfg``;
    returns the replay's counts and the tier's counters (``evicted_objects``:
    the backend's own eviction count; ``inspect(tier)`` adds more) after every
    cascade finished."""
    from kvstore_tiers.admin.harness import build_harness

    h = build_harness([tier_cfg], num_chunks=primary_blocks, chunk_bytes=chunk_bytes,
                      enable_events=False)
    rp: Replayer | None = None
    try:
        rp = Replayer(h, rows)
        t0 = time.perf_counter()
        for req in requests:
            rp.request(req)
        h.settle(timeout_s=600)
        rp.stats.seconds = time.perf_counter() - t0
        tier = h.tiers[0]
        counters = dataclasses.asdict(tier.counters)
        evictions = tier.backend.evictions
        counters["evicted_objects"] = evictions.objects if evictions is not None else 0
        if inspect is not None:
            counters.update(inspect(tier))
        return rp.stats, counters
    finally:
        if rp is not None:
            rp.close()
        h.shutdown()


# -- one tier per backend, sized to a capacity ----------------------------------------------
@dataclass
class TracePlan:
    """What ``bench --trace`` replays."""

    trace: Path
    requests: int | None = None
    tiers: tuple[str, ...] = ("fs",)
    policies: tuple[str, ...] = ("always",)
    capacities: tuple[float, ...] = (2, 5, 10, 20, 50, 100)
    redis_capacities: tuple[float, ...] = (5, 20, 100)
    chunk_kib: int = 32
    primary_blocks: int | None = None
    directory: Path = Path(".bench-kvstore")
    samples_dir: Path | None = None
    min_sightings: int = 2
    extra_tier_keys: dict[str, Any] = field(default_factory=dict)

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_kib << 10


def policy_keys(policy: str, min_sightings: int) -> dict[str, Any]:
    """The tier config keys of an admission policy (none for ``always``, the default)."""
    if policy == "always":
        return {}
    out: dict[str, Any] = {"admission": policy}
    if policy == "reuse":
        out["admission_min_sightings"] = min_sightings
    return out


def fs_object_bytes(root: Path, chunk_bytes: int, rows: np.ndarray) -> tuple[int, int]:
    """(bytes on disk of the namespace directory with no object, bytes on disk per
    object), measured by storing a few blocks with the fs tier's defaults."""
    from kvstore_tiers.backends.fs.capacity import scan

    n = 8
    stats, _ = replay([TraceRequest(0, n * BLOCK_TOKENS, 0, tuple(range(-n, 0)))],
                      {"type": "fs", "root_dir": str(root)}, chunk_bytes, 4 * n, rows)
    if stats.blocks_cascaded != n:
        raise RuntimeError(f"calibration stored {stats.blocks_cascaded} of {n} blocks")
    bases = [p for p in root.rglob(".shards")]
    if len(bases) != 1:
        raise RuntimeError(f"expected one fs namespace under {root}, found {len(bases)}")
    total, objects = scan(bases[0].parent)
    per_object = max(b for _, b, _ in objects)
    shutil.rmtree(root, ignore_errors=True)
    return total - sum(b for _, b, _ in objects), per_object


@contextlib.contextmanager
def redis_for_trace() -> Iterator[tuple[str, Any]]:
    """A redis-server on a free loopback port set up as docs/redis.md recommends
    (``allkeys-lru``, eviction events published); yields (url, client)."""
    import redis

    from kvstore_tiers.tools.bench.redis_bench import redis_server

    with redis_server(["--maxmemory-policy", "allkeys-lru",
                       "--notify-keyspace-events", "Ee"]) as port:
        client = redis.Redis(port=port)
        try:
            yield f"redis://127.0.0.1:{port}/0", client
        finally:
            client.close()


def redis_object_bytes(url: str, client: Any, chunk_bytes: int, rows: np.ndarray) -> int:
    """Redis memory per stored block (``used_memory`` delta over a few stored blocks,
    tier defaults); the server is flushed afterwards."""
    n = 64
    client.flushall()
    before = int(client.info("memory")["used_memory"])
    stats, _ = replay([TraceRequest(0, n * BLOCK_TOKENS, 0, tuple(range(-n, 0)))],
                      {"type": "redis", "url": url}, chunk_bytes, 2 * n, rows)
    after = int(client.info("memory")["used_memory"])
    stored = int(client.dbsize())
    client.flushall()
    if stats.blocks_cascaded != n or stored != n:
        raise RuntimeError(f"calibration stored {stored} of {n} blocks")
    return max(1, (after - before) // n)


def _row(tier: str, policy: str, percent: float, capacity: int, stats: ReplayStats,
         counters: dict[str, Any], ref: trace_reference.ReferenceResult | None,
         chunk_bytes: int, extra: dict[str, Any]) -> dict[str, Any]:
    written = int(counters.get("objects_stored", 0))
    served = stats.tier_tokens_hit
    raw_read = int(counters.get("raw_bytes_read", 0))
    dropped = int(counters.get("stores_dropped", 0)) + int(
        counters.get("stores_dropped_backpressure", 0))
    skipped_admission = sum(int(v) for k, v in counters.items()
                            if k.startswith("stores_not_admitted"))
    row: dict[str, Any] = {
        "tier": tier, "policy": policy, "capacity_percent": percent,
        "capacity_blocks": capacity, "replay": dataclasses.asdict(stats),
        "token_hit_rate": stats.tokens_hit / max(1, stats.tokens_requested),
        "block_hit_rate": stats.blocks_hit / max(1, stats.blocks_requested),
        "tier_token_hit_rate": served / max(1, stats.tokens_requested),
        "tier_block_hit_rate": stats.tier_blocks_hit / max(1, stats.blocks_requested),
        "objects_written": written,
        "bytes_written": written * chunk_bytes,
        "stored_bytes_written": int(counters.get("stored_bytes_written", 0)),
        "bytes_written_per_token_served": (written * chunk_bytes / served) if served else None,
        "scaled_bytes_written": {name: written * b for name, b in SCALES.items()},
        "evictions": int(counters.get("evicted_objects", 0)),
        "stale_hits": int(counters.get("load_misses", 0)),
        "skipped_present": int(counters.get("objects_skipped", 0)),
        "skipped_admission": skipped_admission,
        "stores_dropped": dropped,
        "not_cascaded": stats.blocks_cascaded - written - int(counters.get("objects_skipped", 0))
        - dropped - int(counters.get("store_failures", 0)) - skipped_admission,
        "load_gbps": (raw_read / stats.load_wait_s / 1e9) if stats.load_wait_s else None,
        "counters": counters,
        "reference": ref.as_dict() if ref is not None else None,
        **extra,
    }
    return row


def run(plan: TracePlan, requests: Sequence[TraceRequest],
        progress: Callable[[str], None] = print,
        partial: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every (tier, policy, capacity) of ``plan`` over ``requests``; the result dict.
    ``partial`` gets the result so far after each run (a long run keeps what it did)."""
    chunk = plan.chunk_bytes
    rows = payload_rows(chunk, plan.samples_dir)
    distinct = distinct_blocks(list(requests))
    longest = max(len(r.hash_ids) for r in requests)
    primary = plan.primary_blocks or longest + 2 * STORE_PIECE
    refs: dict[tuple[str, int], trace_reference.ReferenceResult] = {}

    def reference(policy: str, capacity: int) -> trace_reference.ReferenceResult | None:
        if policy not in trace_reference.POLICIES:
            return None
        if (policy, capacity) not in refs:
            refs[policy, capacity] = trace_reference.replay(requests, capacity, policy,
                                                            plan.min_sightings)
        return refs[policy, capacity]

    out = _Rows(partial, {
        "trace": str(plan.trace), "requests": len(requests), "distinct_blocks": distinct,
        "blocks_requested": sum(len(r.hash_ids) for r in requests),
        "chunk_bytes": chunk, "primary_blocks": primary, "store_piece": STORE_PIECE,
        "payload": "real bf16 KV samples" if plan.samples_dir else "random bytes",
        "scales": SCALES, "min_sightings": plan.min_sightings,
        "tier_keys": plan.extra_tier_keys})
    base = plan.directory.resolve() / f"trace-{uuid.uuid4().hex[:8]}"
    try:
        if "fs" in plan.tiers:
            high, low = fs_watermarks(plan.extra_tier_keys)  # a bad one fails before any run
            overhead, per_obj = fs_object_bytes(base / "calibrate", chunk, rows)
            for pct in plan.capacities:
                cap = trace_reference.capacity_blocks(distinct, pct)
                for policy in plan.policies:
                    root = base / f"fs-{pct}-{policy}"
                    # The evictor keeps the objects between the watermarks (fractions
                    # of the room max_bytes leaves beside the shard directories):
                    # sized so that their middle holds `cap` blocks.
                    cfg = {"type": "fs", "root_dir": str(root), **TIER_KEYS,
                           **policy_keys(policy, plan.min_sightings), **plan.extra_tier_keys,
                           "high_watermark": high, "low_watermark": low,
                           "max_bytes": overhead + int(cap * per_obj / ((high + low) / 2))}
                    progress(f"fs {pct:g} % {policy}")
                    stats, counters = replay(requests, cfg, chunk, primary, rows)
                    out.append(_row("fs", policy, pct, cap, stats, counters,
                                    reference(policy, cap), chunk,
                                    {"max_bytes": cfg["max_bytes"],
                                     "overhead_bytes": overhead,
                                     "disk_bytes_per_object": per_obj,
                                     "watermarks": [high, low]}))
                    shutil.rmtree(root, ignore_errors=True)
        if "redis" in plan.tiers:
            with redis_for_trace() as (url, client):
                per_key = redis_object_bytes(url, client, chunk, rows)
                for pct in plan.redis_capacities:
                    cap = trace_reference.capacity_blocks(distinct, pct)
                    for policy in plan.policies:
                        client.flushall()
                        client.config_resetstat()
                        maxmemory = int(client.info("memory")["used_memory"]) + cap * per_key
                        client.config_set("maxmemory", maxmemory)
                        cfg = {"type": "redis", "url": url, **TIER_KEYS,
                               "backpressure": dict(REMOTE_BACKPRESSURE),
                               **policy_keys(policy, plan.min_sightings),
                               **plan.extra_tier_keys}
                        progress(f"redis {pct:g} % {policy}")
                        stats, counters = replay(requests, cfg, chunk, primary, rows)
                        info = client.info("stats")
                        counters["evicted_objects"] = int(info["evicted_keys"])
                        out.append(_row("redis", policy, pct, cap, stats, counters,
                                        reference(policy, cap), chunk,
                                        {"maxmemory": maxmemory, "memory_per_object": per_key,
                                         "keys_at_end": int(client.dbsize())}))
                        client.config_set("maxmemory", 0)
        if "s3" in plan.tiers:
            _s3_rows(out, plan, requests, rows, primary, distinct, reference, progress)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return out.result


class _Rows(list):
    """The rows of a run; each one added hands the result so far to ``partial``."""

    def __init__(self, partial: Callable[[dict[str, Any]], None] | None,
                 head: dict[str, Any]) -> None:
        super().__init__()
        self.partial = partial
        self.result = {**head, "rows": self}

    def append(self, row: dict[str, Any]) -> None:
        super().append(row)
        if self.partial is not None:
            self.partial(self.result)


def _s3_rows(out: list[dict[str, Any]], plan: TracePlan, requests: Sequence[TraceRequest],
             rows: np.ndarray, primary: int, distinct: int,
             reference: Callable[[str, int], trace_reference.ReferenceResult | None],
             progress: Callable[[str], None]) -> None:
    """s3 on a local moto server: no capacity, so 100 % only; PUTs as the backend counts
    them. Appends one row per policy to ``out``."""
    import boto3

    from kvstore_tiers.tools.bench.s3_bench import FAKE_KEYS, moto_server

    with moto_server() as endpoint:
        admin = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **FAKE_KEYS)
        for policy in plan.policies:
            bucket = f"kvtrace-{uuid.uuid4().hex[:12]}"
            admin.create_bucket(Bucket=bucket)
            cfg = {"type": "s3", "bucket": bucket, "endpoint_url": endpoint, **TIER_KEYS,
                   "region": "us-east-1", **FAKE_KEYS,
                   "backpressure": dict(REMOTE_BACKPRESSURE),
                   **policy_keys(policy, plan.min_sightings), **plan.extra_tier_keys}
            progress(f"s3 100 % {policy}")
            stats, counters = replay(requests, cfg, plan.chunk_bytes, primary, rows,
                                     lambda tier: {"requests_by_kind": dict(tier.backend.requests)})
            out.append(_row("s3", policy, 100.0, distinct, stats, counters,
                            reference(policy, distinct), plan.chunk_bytes,
                            {"requests_by_kind": counters.pop("requests_by_kind")}))
