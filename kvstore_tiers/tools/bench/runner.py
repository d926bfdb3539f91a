"""The ``kvstore-tiers bench`` driver: runs the benchmark modules of a plan and
returns one result dict (the command prints it with :mod:`.tables`, writes it
as JSON and plots it with :mod:`.plots`).

The measurements are :mod:`.fs_bench`'s (ours vs vLLM's stock fs tier, disk
O_DIRECT, CPU per GB, steps to HIT, scheduler-thread cost, codecs on real
KV), :mod:`.redis_bench`'s (tier vs redis-benchmark on its own server, or vs
a redis-py loop on the user's) and :mod:`.s3_bench`'s (tier vs a raw
aiobotocore loop on its own moto or the user's bucket), each against its own
baseline in the same run; first, :func:`.cpu.reference` measures this
machine's memcpy and CRC-32C, the reference of every load figure.
"""

from __future__ import annotations

import contextlib
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
    #: kvstore_tiers.tools.bench.fs_bench.reload_rounds.
    reload_rounds: int = 0
    redis_blocks: int = 256
    #: redis-benchmark moves run to run by +-50 % on 2 cores: at least this many rounds.
    redis_min_rounds: int = 5
    s3_blocks: int = 64
    #: Bytes of the memcpy and CRC-32C reference (:func:`.cpu.reference`), MiB.
    reference_mib: int = 256
    directory: Path = field(default_factory=lambda: Path(".bench-kvstore"))
    samples_dir: Path | None = None
    #: The user's Redis (None: start one). May hold a password: never in a report.
    redis_url: str | None = field(default=None, repr=False)
    #: The user's bucket (None: a local moto_server), its endpoint (None: AWS),
    #: the prefix the benchmark writes under, and the region.
    s3_bucket: str | None = None
    s3_endpoint: str | None = None
    s3_prefix: str = ""
    s3_region: str | None = None

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


def describe(plan: BenchPlan) -> dict[str, Any]:
    """The plan as JSON values, the Redis URL reduced to host:port/db."""
    from kvstore_tiers.tools.bench.redis_bench import server_label

    out = {k: (str(v) if isinstance(v, Path) else v) for k, v in plan.__dict__.items()}
    if plan.redis_url is not None:
        out["redis_url"] = server_label(plan.redis_url)
    return out


def code_info() -> dict[str, str]:
    """Which checkout's code ran (path, and its git commit when it is a checkout):
    two checkouts measured in turn tell their results apart by it."""
    import os
    import subprocess

    import kvstore_tiers

    path = os.path.dirname(os.path.dirname(os.path.abspath(kvstore_tiers.__file__)))
    info = {"path": path}
    # Not a checkout (an installed wheel): the path says enough.
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        info["commit"] = subprocess.run(
            ["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True,
            timeout=10, check=True).stdout.strip()
    return info


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


def run(plan: BenchPlan, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the plan; returns ``{"plan", "machine", "reference", "fs"?, "redis"?, "s3"?,
    "seconds"}`` (``reference``: this machine's single-thread memcpy and CRC-32C GB/s)."""
    from kvstore_tiers.tools.bench import cpu, fs_bench

    t0 = time.time()
    result: dict[str, Any] = {
        "plan": describe(plan), "machine": machine_info(), "code": code_info(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "reference": cpu.reference(plan.reference_mib * MiB),
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
        from kvstore_tiers.tools.bench import redis_bench

        own = plan.redis_url is None
        if own and (shutil.which("redis-server") is None
                    or shutil.which("redis-benchmark") is None):
            progress("redis: redis-server/redis-benchmark not installed; skipped")
        else:
            progress("redis: tier vs redis-benchmark ..." if own else
                     f"redis: tier vs a redis-py loop on {describe(plan)['redis_url']} ...")
            result["redis"] = redis_bench.run(
                block_bytes=2 * MiB, blocks=plan.redis_blocks,
                rounds=max(plan.rounds, plan.redis_min_rounds), samples_dir=plan.samples_dir,
                url=plan.redis_url)
            progress("redis: done")
    if "s3" in plan.tiers:
        from kvstore_tiers.tools.bench import s3_bench

        where = f"bucket {plan.s3_bucket}" if plan.s3_bucket else "a local moto_server"
        progress(f"s3: tier vs raw aiobotocore on {where} ...")
        result["s3"] = s3_bench.run(plan.s3_endpoint, plan.s3_bucket, plan.s3_blocks, 1.0, 32,
                                    plan.rounds, plan.samples_dir, prefix=plan.s3_prefix,
                                    region=plan.s3_region)
        progress("s3: done")
    result["seconds"] = time.time() - t0
    return result


def write_json(result: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str))
    return path
