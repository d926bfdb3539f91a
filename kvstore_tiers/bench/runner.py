"""The ``kvstore-tiers bench`` driver: runs the existing benchmark modules, shows
progress, prints the tables, writes one JSON result and the PNG plots.

Nothing is measured here: :mod:`fs_bench` (ours vs vLLM's stock fs tier, disk
O_DIRECT, steps to HIT, scheduler-thread cost, codecs on real KV),
:mod:`redis_bench` (tier vs redis-benchmark) and :mod:`s3_bench` (tier vs a
raw aiobotocore loop on moto or a given endpoint) do it, each against its own
baseline in the same run. Presets keep the default run near 5 minutes and
``--quick`` near 1 minute on a 2-core machine.
"""

from __future__ import annotations

import json
import platform
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KiB, MiB = 1 << 10, 1 << 20


@dataclass
class BenchPlan:
    """What one ``bench`` run measures."""

    tiers: tuple[str, ...] = ("fs",)
    chunk_kib: tuple[int, ...] = (256, 2048, 8192)
    total_mib: int = 64
    rounds: int = 2
    compression_mib: int = 32
    scheduler_in_flight: int = 1024
    #: Load-only rounds per fs chunk size and request count (0: none); see
    #: kvstore_tiers.bench.fs_bench.reload_rounds.
    reload_rounds: int = 0
    redis_blocks: int = 256
    #: redis-benchmark moves run to run by +-50 % on 2 cores: at least this many rounds.
    redis_min_rounds: int = 5
    s3_blocks: int = 64
    directory: Path = field(default_factory=lambda: Path(".bench-kvstore"))
    samples_dir: Path | None = None

    @classmethod
    def quick(cls, **kw: Any) -> BenchPlan:
        return cls(chunk_kib=(256, 2048), total_mib=32, rounds=1, compression_mib=8,
                   scheduler_in_flight=512, redis_blocks=32, redis_min_rounds=1,
                   s3_blocks=32, **kw)

    def fs_steps(self) -> int:
        # per chunk: disk + (1, 4 requests) [+ reload (1, 4)]; then scheduler x2,
        # twice; then compression
        per_chunk = 3 + (2 if self.reload_rounds else 0)
        return len(self.chunk_kib) * per_chunk + 4 + (1 if self.samples_dir else 0)


def machine_info() -> dict[str, Any]:
    import os

    info: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(),
                            "cpus": os.cpu_count()}
    try:
        import vllm

        info["vllm"] = vllm.__version__
    except Exception:  # a report without the version is still a report
        pass
    return info


def _scheduler_table(sched: dict[str, Any], phase: str) -> Any:
    from rich.table import Table

    s = Table(title="scheduler-thread time, microseconds (our jobs: 16 chunks of 256 KiB; "
              f"calls, then per chunk moved; {phase})")
    for col in ("method", "ours p50", "vLLM p50", "ours p99", "vLLM p99",
                "ours p99/chunk", "vLLM p99/chunk", "no GC: ours p99", "vLLM p99",
                "ours p99/chunk", "vLLM p99/chunk", "GC in calls ours/vLLM",
                "GC allocs/call ours/vLLM"):
        s.add_column(col, justify="right")
    ours, stock = sched.get("kvstore", {}), sched.get("vllm", {})

    def cell(d: dict[str, Any], k: str) -> str:
        return f"{d[k]:.1f}" if k in d else "-"

    for m in ours:
        st = stock.get(m, {})
        s.add_row(m, *(cell(d, k) for k in ("p50_us", "p99_us", "p99_us_per_chunk",
                                             "p99_us_no_gc", "p99_us_per_chunk_no_gc")
                       for d in (ours[m], st)),
                  f"{ours[m].get('gc_calls', '-')}/{st.get('gc_calls', '-')}",
                  f"{cell(ours[m], 'net_gc_allocs')}/{cell(st, 'net_gc_allocs')}")
    return s


def run(plan: BenchPlan, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the plan; returns ``{"plan", "machine", "fs"?, "redis"?, "s3"?, "seconds"}``."""
    from kvstore_tiers.bench import fs_bench

    t0 = time.time()
    result: dict[str, Any] = {
        "plan": {k: (str(v) if isinstance(v, Path) else v) for k, v in plan.__dict__.items()},
        "machine": machine_info(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if "fs" in plan.tiers:
        directory = plan.directory
        directory.mkdir(parents=True, exist_ok=True)
        try:
            result["fs"] = fs_bench.run(
                directory.resolve(), [k * KiB for k in plan.chunk_kib], plan.total_mib * MiB,
                plan.rounds, progress, samples_dir=plan.samples_dir,
                compression_mib=plan.compression_mib,
                scheduler_in_flight=plan.scheduler_in_flight, reload=plan.reload_rounds)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    if "redis" in plan.tiers:
        from kvstore_tiers.bench import redis_bench

        if shutil.which("redis-server") is None or shutil.which("redis-benchmark") is None:
            progress("redis: redis-server/redis-benchmark not installed; skipped")
        else:
            progress("redis: tier vs redis-benchmark ...")
            kw: dict[str, Any] = {}
            if plan.samples_dir is not None:
                kw["samples_dir"] = plan.samples_dir
            result["redis"] = redis_bench.run(
                block_bytes=2 * MiB, blocks=plan.redis_blocks,
                rounds=max(plan.rounds, plan.redis_min_rounds), **kw)
            progress("redis: done")
    if "s3" in plan.tiers:
        from kvstore_tiers.bench import s3_bench

        progress("s3: tier vs raw aiobotocore on a local moto_server ...")
        result["s3"] = s3_bench.run(None, None, plan.s3_blocks, 1.0, 32, plan.rounds,
                                    plan.samples_dir or Path("/nonexistent"), None)
        progress("s3: done")
    result["seconds"] = time.time() - t0
    return result


# -------------------------------------------------------------------- tables
def _size(c: int) -> str:
    return f"{c // KiB} KiB" if c < MiB else f"{c // MiB} MiB"


def _reload_table(rows: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    t = Table(title="fs reload: load-only rounds rereading the same stored files "
              "(GB/s, median of rounds; x: geometric mean over AB/BA round pairs, "
              "approximate 95 % interval)")
    for col in ("chunk", "reqs", "rounds", "load ours", "load vLLM", "x", "95 % interval"):
        t.add_column(col, justify="right")
    for r in rows:
        low, high = r["load_ratio_ci95"]
        t.add_row(_size(r["chunk_bytes"]), str(r["requests"]), str(r["rounds"]),
                  f"{r['kvstore_load_gbps']:.2f}", f"{r['vllm_load_gbps']:.2f}",
                  f"{r['load_ratio']:.2f}", f"{low:.2f}-{high:.2f}")
    return t


def print_tables(result: dict[str, Any], console: Any = None) -> None:
    """Rich tables of everything in ``result``: each number beside its baseline."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    fs = result.get("fs")
    if fs:
        disk = "disk O_DIRECT" if fs.get("disk_o_direct", True) else "disk buffered (no O_DIRECT)"
        t = Table(title=f"fs: kvstore-tiers vs vLLM stock fs tier vs {disk} "
                  "(GB/s, median of rounds; x: ours/vLLM balanced over AB/BA round pairs; "
                  "same run)")
        for col in ("chunk", "reqs", "store ours", "store vLLM", "x", "disk write",
                    "store/disk", "load ours", "load vLLM", "x", "disk read", "load/disk",
                    "no-RETRY steps ours/vLLM", "steps to HIT ours/vLLM"):
            t.add_column(col, justify="right")
        for r in fs["throughput"]:
            d = fs["disk"].get(r["chunk_bytes"]) or fs["disk"].get(str(r["chunk_bytes"]))
            t.add_row(_size(r["chunk_bytes"]), str(r["requests"]),
                      f"{r['kvstore_store_gbps']:.2f}", f"{r['vllm_store_gbps']:.2f}",
                      f"{r['store_ratio']:.2f}", f"{d['write_gbps']:.2f}",
                      f"{r['store_vs_disk_write']:.0%}",
                      f"{r['kvstore_load_gbps']:.2f}", f"{r['vllm_load_gbps']:.2f}",
                      f"{r['load_ratio']:.2f}", f"{d['read_gbps']:.2f}",
                      f"{r['load_vs_disk_read']:.0%}",
                      f"{r.get('kvstore_lookup_steps', '?')}/{r.get('vllm_lookup_steps', '?')}",
                      f"{r.get('kvstore_steps_to_hit', '?')}/{r.get('vllm_steps_to_hit', '?')}")
        console.print(t)
        if fs.get("reload"):
            console.print(_reload_table(fs["reload"]))
        for section, phase in (("scheduler", "the waves fix the GC's phase"),
                               ("scheduler_gc_random_phase", "GC phase random per wave")):
            if fs.get(section):
                console.print(_scheduler_table(fs[section], phase))
        ours, stock = fs["scheduler"].get("kvstore", {}), fs["scheduler"].get("vllm", {})
        floor = [d.get("get_finished_jobs", {}).get("p99_us_empty_polls", 0.0)
                 for d in (ours, stock)]
        console.print("no GC: calls in which Python's cyclic GC ran (it collects the whole "
                      "process and starts in whichever thread allocates past its threshold) "
                      "left out. Noise floor, p99 of get_finished_jobs calls that reported "
                      f"nothing (sub-microsecond work): ours {floor[0]:.1f} us, "
                      f"vLLM {floor[1]:.1f} us")
        if fs.get("compression"):
            c = Table(title="codecs on real bf16 KV (our fs tier; effective = raw KV GB/s)")
            for col in ("sample", "block", "codec", "ratio", "store eff. GB/s",
                        "load eff. GB/s"):
                c.add_column(col, justify="right")
            for r in fs["compression"]:
                c.add_row(r["file"], _size(r["block_bytes"]), r["codec"], f"{r['ratio']:.3f}",
                          f"{r['store_effective_gbps']:.2f}", f"{r['load_effective_gbps']:.2f}")
            console.print(c)
    if "redis" in result:
        b = result["redis"]["bandwidth"]
        t = Table(title=f"redis: tier vs redis-benchmark ({b['block_bytes'] // KiB} KiB values, "
                  "MiB/s, median of rounds; x: balanced over AB/BA round pairs)")
        for col in ("op", "tier", "redis-benchmark (distinct keys)", "x"):
            t.add_column(col, justify="right")
        for op in ("set", "get"):
            t.add_row(op.upper(), f"{b[f'tier_{op}_MiBps']:.0f}",
                      f"{b[f'redis_benchmark_keys_{op}_MiBps']:.0f}",
                      f"{b[f'{op}_ratio_keys']:.2f}")
        if "tier_get_transfer_MiBps" in b:
            t.add_row("GET, transfer only", f"{b['tier_get_transfer_MiBps']:.0f}",
                      f"{b['redis_benchmark_keys_get_MiBps']:.0f}",
                      f"{b['get_transfer_ratio_keys']:.2f}")
        console.print(t)
    if "s3" in result:
        g = result["s3"]["gbps"]
        t = Table(title=f"s3 on {result['s3']['server']}: tier vs raw aiobotocore (GB/s)")
        for col in ("op", "tier", "raw aiobotocore", "tier / raw", "boto3 threads"):
            t.add_column(col, justify="right")
        t.add_row("store/PUT", f"{g['tier_store']:.3f}", f"{g['aio_put']:.3f}",
                  f"{g['tier_store'] / g['aio_put']:.2f}", f"{g['threads_put']:.3f}")
        t.add_row("load/GET", f"{g['tier_load']:.3f}", f"{g['aio_get']:.3f}",
                  f"{g['tier_load'] / g['aio_get']:.2f}", f"{g['threads_get']:.3f}")
        console.print(t)


def write_json(result: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str))
    return path
