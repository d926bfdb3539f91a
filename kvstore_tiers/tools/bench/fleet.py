"""The fleet replay: a request trace dealt to N nodes sharing one remote tier.

Run by ``kvstore-tiers bench --trace PATH --nodes N``. A fleet is N nodes,
each a vLLM engine with its own CPU primary and node-local fs tier on NVMe,
all sharing one S3 bucket or one Redis. Here each node is a process
(:mod:`.fleet_node`, started with ``spawn``) holding vLLM's real
``TieringOffloadingManager`` with the chain ``[fs, remote]``: fs with its own
``root_dir`` and ``max_bytes`` for ``--capacity`` % of the replayed working
set (per node), the remote one moto S3 server or one redis-server this
module starts (no capacity: it keeps every block). Each node is driven as
the single-node replay (:mod:`.trace`) drives its manager.

**Order.** The coordinator (this process) deals the trace's requests in
file order: it sends a request to its node and waits for the node's reply
before it sends the next one, and a node replies once the request's
cascades reached its tiers. So the fleet sees the trace's order, a block is
in the remote before any later request looks it up, and a run's counts do
not depend on timing, except through when an fs evictor runs and where
vLLM, scanning past a RETRY, promotes a block behind a miss whose check was
the slower (a GET without a hit, as in an engine). The price:
the nodes never run at once, so a run takes as long as the requests
together, and two nodes never race to compute the same new block (the
duplicate writes counted here are those of blocks a node recomputes after a
failed load or behind an earlier miss, not those of concurrent requests).

**Routing** (``--routing``): :mod:`.routing` deals the requests (round-robin,
prefix affinity by jump consistent hash, consistent hashing with bounded
loads, a cache-aware router's balance threshold) before the run, from the
trace alone. The key of the prefix routings is the vLLM block hash of the
request's block at position ``affinity_blocks - 1`` (its last block if
shorter): by the traces' chain property that block names the whole prefix
before it. One block is the textbook choice but useless here: every request
of the Mooncake conversation trace starts with the same block (a shared
system prompt), so it would send the whole trace to one node; two blocks
(1,024 tokens) tell the conversations apart. Each run reports its requests
per node and their max/mean beside the remote GETs.

**Read-through** (``--read-through``): "on" adds ``"read_through": true`` to
each node's fs tier (it then also caches the blocks vLLM promotes from the
remote), nothing else.
"""

from __future__ import annotations

import contextlib
import itertools
import shutil
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvstore_tiers.tools.bench import trace, trace_reference
from kvstore_tiers.tools.bench.routing import ROUTINGS, RoutingKnobs, balance, route
from kvstore_tiers.tools.bench.trace_file import TraceRequest, distinct_blocks

REMOTES = ("redis", "s3")
#: Seconds a node may take to answer one message (a request, or building its manager).
NODE_TIMEOUT_S = 900.0


@dataclass
class FleetPlan:
    """What ``bench --trace --nodes`` replays."""

    trace: Path
    nodes: int = 4
    remotes: tuple[str, ...] = REMOTES
    routings: tuple[str, ...] = ROUTINGS
    read_through: tuple[bool, ...] = (False, True)
    capacities: tuple[float, ...] = (10.0,)
    knobs: RoutingKnobs = field(default_factory=RoutingKnobs)
    chunk_kib: int = 32
    primary_blocks: int | None = None
    directory: Path = Path(".bench-kvstore")
    samples_dir: Path | None = None


class _Nodes:
    """The node processes and the coordinator's end of their pipes."""

    def __init__(self, n: int) -> None:
        import multiprocessing

        from kvstore_tiers.tools.bench.fleet_node import serve

        ctx = multiprocessing.get_context("spawn")
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        for i in range(n):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=serve, args=(theirs,), name=f"kvstore-fleet-node-{i}",
                               daemon=True)
            proc.start()
            theirs.close()
            self.conns.append(mine)
            self.procs.append(proc)

    def send(self, i: int, op: str, arg: Any = None) -> None:
        self.conns[i].send((op, arg))

    def reply(self, i: int) -> Any:
        conn = self.conns[i]
        if not conn.poll(NODE_TIMEOUT_S):
            raise TimeoutError(f"fleet node {i} did not answer in {NODE_TIMEOUT_S:.0f} s")
        try:
            status, value = conn.recv()
        except EOFError:
            raise RuntimeError(f"fleet node {i} died (exit code "
                               f"{self.procs[i].exitcode})") from None
        if status == "error":
            raise RuntimeError(f"fleet node {i}: {value}")
        return value

    def call(self, i: int, op: str, arg: Any = None) -> Any:
        self.send(i, op, arg)
        return self.reply(i)

    def each(self, op: str, args: Sequence[Any]) -> list[Any]:
        """``op`` on every node at once; their replies in node order."""
        for i, arg in enumerate(args):
            self.send(i, op, arg)
        return [self.reply(i) for i in range(len(args))]

    def close(self) -> None:
        """Ask every node to stop; end those still running 30 s later."""
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(("stop", None))
        for conn, proc in zip(self.conns, self.procs, strict=True):
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=10)
            conn.close()


@dataclass
class _Remote:
    """The shared remote of a run: its tier config, and how many objects it holds."""

    fresh: Callable[[], dict[str, Any]]
    objects: Callable[[], int]


@contextlib.contextmanager
def remote_server(kind: str) -> Iterator[_Remote]:
    """The shared remote ``kind`` (redis or s3) on a server started here."""
    keys = {**trace.TIER_KEYS, "backpressure": dict(trace.REMOTE_BACKPRESSURE)}
    if kind == "redis":
        with trace.redis_for_trace() as (url, client):
            def fresh_redis() -> dict[str, Any]:
                client.flushall()
                return {"type": "redis", "url": url, **keys}

            yield _Remote(fresh_redis, lambda: int(client.dbsize()))
        return
    if kind != "s3":
        raise ValueError(f"unknown remote {kind!r} (have {REMOTES})")
    import boto3

    from kvstore_tiers.tools.bench.s3_bench import FAKE_KEYS, moto_server

    with moto_server() as endpoint:
        admin = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **FAKE_KEYS)
        bucket = [""]

        def fresh_s3() -> dict[str, Any]:
            bucket[0] = f"kvfleet-{uuid.uuid4().hex[:12]}"
            admin.create_bucket(Bucket=bucket[0])
            return {"type": "s3", "bucket": bucket[0], "endpoint_url": endpoint,
                    "region": "us-east-1", **FAKE_KEYS, **keys}

        def count() -> int:
            # Blocks only: not the namespace's run config the tier writes beside them.
            pages = admin.get_paginator("list_objects_v2").paginate(Bucket=bucket[0])
            return sum(not o["Key"].endswith("/config.json")
                       for page in pages for o in page.get("Contents", ()))

        yield _Remote(fresh_s3, count)


def summarise(nodes: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-node figures and their totals from the nodes' results (:mod:`.fleet_node`)."""
    per_node = []
    for i, r in enumerate(nodes):
        rp, fs, rem = r["replay"], r["fs"], r["remote"]
        per_node.append({
            "node": i, "requests": rp["requests"], "blocks_requested": rp["blocks_requested"],
            "blocks_hit": rp["blocks_hit"], "hits": dict(r["hits"]),
            "remote_gets": {"objects": rem["objects_loaded"], "bytes": rem["stored_bytes_read"]},
            "remote_puts": {"objects": rem["objects_stored"],
                            "bytes": rem["stored_bytes_written"]},
            # Keys the remote reported stored (written, or there already) and failed ones.
            "remote_put_attempts": r["remote_offered"] + rem["store_failures"],
            "remote_existed": r["remote_offered"] - rem["objects_stored"],
            "remote_repeats": r["remote_repeats"],
            "fs_written": fs["objects_stored"], "fs_evictions": fs["evicted_objects"],
            "read_through_stored": fs.get("read_through_stored", 0),
            "read_through_dropped": fs.get("read_through_dropped", 0),
            "stale_hits": fs["load_misses"] + rem["load_misses"],
            "requests_by_kind": r["requests_by_kind"], "seconds": rp["seconds"],
            "counters": {"fs": fs, "remote": rem}})
    total: dict[str, Any] = {"hits": Counter()}
    for n in per_node:
        total["hits"].update(n["hits"])
        for k, v in n.items():
            if isinstance(v, int) and k != "node":
                total[k] = total.get(k, 0) + v
            elif k in ("remote_gets", "remote_puts"):
                total.setdefault(k, Counter()).update(v)
    owners = Counter(b for r in nodes for b in r["remote_blocks"])
    requested = max(1, total["blocks_requested"])
    return {
        **{k: dict(v) if isinstance(v, Counter) else v for k, v in total.items()},
        "block_hit_rate": total["blocks_hit"] / requested,
        "hit_rate_by_source": {s: h / requested for s, h in total["hits"].items()},
        "remote_blocks": len(owners),
        "duplicate_blocks": sum(1 for c in owners.values() if c > 1),
        "per_node": per_node,
    }


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (remote, capacity): what read-through does to remote GETs under
    round-robin; what prefix-affinity routing alone does to them (``affinity_cut``)
    and how that compares with read-through's cut (``routing_share_of_gain``: 1.0,
    routing alone saves as many GETs as read-through)."""
    by = {(r["remote"], r["capacity_percent"], r["routing"], r["read_through"]): r
          for r in rows}
    out = []
    for remote, pct in dict.fromkeys((r["remote"], r["capacity_percent"]) for r in rows):
        off, on = by.get((remote, pct, "round-robin", False)), by.get(
            (remote, pct, "round-robin", True))
        if off is None or on is None:
            continue
        gets_off, gets_on = off["remote_gets"]["objects"], on["remote_gets"]["objects"]
        cut = 1 - gets_on / gets_off if gets_off else None
        t = {"remote": remote, "capacity_percent": pct, "remote_gets_off": gets_off,
             "remote_gets_on": gets_on, "read_through_cut": cut,
             # A node's repeat remote loads: what read-through could save at most.
             "cut_bound": off["remote_repeats"] / gets_off if gets_off else None,
             "hit_rate_off": off["block_hit_rate"], "hit_rate_on": on["block_hit_rate"],
             "met": cut is not None and cut >= 0.30
             and on["block_hit_rate"] >= off["block_hit_rate"]}
        aff = by.get((remote, pct, "affinity", False))
        if aff is not None:
            gets_aff = aff["remote_gets"]["objects"]
            t["remote_gets_affinity_off"] = gets_aff
            t["affinity_cut"] = 1 - gets_aff / gets_off if gets_off else None
            t["routing_share_of_gain"] = ((gets_off - gets_aff) / (gets_off - gets_on)
                                          if gets_off != gets_on else None)
        aff_on = by.get((remote, pct, "affinity", True))
        if aff_on is not None:
            t["remote_gets_affinity_on"] = aff_on["remote_gets"]["objects"]
        out.append(t)
    return out


def routing_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (remote, capacity, read-through, routing): the load (requests per node,
    max/mean) beside the remote GETs, their cut against round-robin, and that cut as
    a share of prefix affinity's (``of_affinity_cut``: 1.0, as much locality as
    affinity; None without both baselines)."""
    by = {(r["remote"], r["capacity_percent"], r["read_through"], r["routing"]): r
          for r in rows}
    out = []
    for (remote, pct, rt, routing), r in by.items():
        gets = r["remote_gets"]["objects"]
        rr, aff = by.get((remote, pct, rt, "round-robin")), by.get((remote, pct, rt, "affinity"))
        base = rr["remote_gets"]["objects"] if rr else None
        cut = 1 - gets / base if base else None
        aff_saved = base - aff["remote_gets"]["objects"] if base and aff else None
        out.append({"remote": remote, "capacity_percent": pct, "read_through": rt,
                    "routing": routing, "requests_per_node": r["requests_per_node"],
                    "max_over_mean": r["max_over_mean"], "remote_gets": gets,
                    "block_hit_rate": r["block_hit_rate"], "cut_vs_round_robin": cut,
                    "of_affinity_cut": (base - gets) / aff_saved if aff_saved else None})
    return out


@dataclass
class _Setup:
    """What every run of a fleet replay shares."""

    plan: FleetPlan
    requests: Sequence[TraceRequest]
    nodes: _Nodes
    chunk_bytes: int
    primary_blocks: int
    fs_bytes: tuple[int, int]  # (the namespace's fixed bytes on disk, bytes per object)

    def fs_keys(self, cap: int) -> dict[str, Any]:
        """A node's fs tier holding ``cap`` blocks, but ``root_dir`` and ``read_through``:
        as in the single-node replay, the middle of the evictor's band holds ``cap``."""
        high, low = trace.FS_WATERMARKS
        overhead, per_obj = self.fs_bytes
        return {"type": "fs", **trace.TIER_KEYS, "high_watermark": high, "low_watermark": low,
                "max_bytes": overhead + int(cap * per_obj / ((high + low) / 2))}

    def replay(self, fs_keys: dict[str, Any], remote_cfg: dict[str, Any], root: Path,
               routing: str, read_through: bool) -> dict[str, Any]:
        """One run: every node's manager built, the trace dealt by ``routing``, the
        nodes' results summarised (:func:`summarise`)."""
        n = self.plan.nodes
        fs = {**fs_keys, **({"read_through": True} if read_through else {})}
        samples = str(self.plan.samples_dir) if self.plan.samples_dir else None
        self.nodes.each("start", [
            {"tiers": [{**fs, "root_dir": str(root / f"node-{i}")}, remote_cfg],
             "chunk_bytes": self.chunk_bytes, "primary_blocks": self.primary_blocks,
             "samples_dir": samples} for i in range(n)])
        assignment = route(self.requests, n, routing, self.plan.knobs)
        for req, i in zip(self.requests, assignment, strict=True):
            self.nodes.call(i, "request", (req.timestamp_ms, req.input_length,
                                           req.output_length, req.hash_ids))
        return {**summarise(self.nodes.each("finish", [None] * n)),
                **balance(assignment, n)}


def _runs(setup: _Setup, out: list[dict[str, Any]], distinct: int, base: Path,
          progress: Callable[[str], None]) -> None:
    """Every run of the plan, remote by remote; appends one row per run to ``out``."""
    plan = setup.plan
    for remote in plan.remotes:
        with remote_server(remote) as server:
            for pct, routing, rt in itertools.product(plan.capacities, plan.routings,
                                                      plan.read_through):
                cap = trace_reference.capacity_blocks(distinct, pct)
                fs_keys = setup.fs_keys(cap)
                progress(f"{remote}, {plan.nodes} nodes, {routing}, read-through "
                         f"{'on' if rt else 'off'}, fs {pct:g} % per node")
                root = base / f"{remote}-{pct:g}-{routing}-{int(rt)}"
                t0 = time.perf_counter()
                row = setup.replay(fs_keys, server.fresh(), root, routing, rt)
                out.append({"remote": remote, "routing": routing, "read_through": rt,
                            "capacity_percent": pct, "capacity_blocks": cap,
                            "max_bytes": fs_keys["max_bytes"],
                            "seconds": time.perf_counter() - t0,
                            "remote_objects_on_server": server.objects(), **row})
                shutil.rmtree(root, ignore_errors=True)


def run(plan: FleetPlan, requests: Sequence[TraceRequest],
        progress: Callable[[str], None] = print,
        partial: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every (remote, capacity, routing, read-through) of ``plan`` over ``requests``;
    the result dict. ``partial`` gets the result so far after each run."""
    chunk = plan.chunk_kib << 10
    distinct = distinct_blocks(list(requests))
    primary = plan.primary_blocks or max(len(r.hash_ids) for r in requests) + 2 * trace.STORE_PIECE
    out = trace._Rows(partial, {
        "trace": str(plan.trace), "requests": len(requests), "distinct_blocks": distinct,
        "blocks_requested": sum(len(r.hash_ids) for r in requests), "nodes": plan.nodes,
        "routing_knobs": asdict(plan.knobs), "chunk_bytes": chunk,
        "primary_blocks": primary, "watermarks": list(trace.FS_WATERMARKS),
        "payload": "real bf16 KV samples" if plan.samples_dir else "random bytes"})
    base = plan.directory.resolve() / f"fleet-{uuid.uuid4().hex[:8]}"
    nodes: _Nodes | None = None
    try:
        nodes = _Nodes(plan.nodes)
        overhead, per_obj = nodes.call(0, "calibrate", {
            "root_dir": str(base / "calibrate"), "chunk_bytes": chunk,
            "samples_dir": str(plan.samples_dir) if plan.samples_dir else None})
        out.result.update(fs_overhead_bytes=overhead, fs_bytes_per_object=per_obj)
        _runs(_Setup(plan, requests, nodes, chunk, primary, (overhead, per_obj)), out,
              distinct, base, progress)
    finally:
        if nodes is not None:
            nodes.close()
        shutil.rmtree(base, ignore_errors=True)
    out.result["targets"] = targets(list(out))
    out.result["routing"] = routing_table(list(out))
    return out.result
