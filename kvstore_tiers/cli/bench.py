"""``kvstore-tiers bench``: our tiers vs vLLM's stock fs tier and the machine's limits."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from kvstore_tiers.cli._common import require_extra


@click.command()
@click.option("--tier", "tiers", type=click.Choice(["fs", "redis", "s3"]), multiple=True,
              default=("fs",), show_default=True,
              help="Tiers to measure (repeatable). fs runs beside vLLM's stock fs tier and "
              "disk O_DIRECT; redis beside redis-benchmark (own redis-server); s3 beside a "
              "raw aiobotocore loop (own moto_server).")
@click.option("--quick", is_flag=True, help="About 1 minute: 256 KiB and 2 MiB, one round.")
@click.option("--chunk-kib", "chunk_kib", type=click.IntRange(4), multiple=True,
              help="Chunk sizes in KiB (repeatable; default 256, 2048, 8192).")
@click.option("--total-mib", type=click.IntRange(4), default=None,
              help="Data per round and chunk size (default 64, quick 32); a window "
              "moves at least 256 chunks (up to 1 GiB) whatever this says.")
@click.option("--rounds", type=click.IntRange(1), default=None,
              help="Alternating rounds per measurement, rounded up to AB/BA pairs; "
              "ratios are balanced over the pairs (default 2).")
@click.option("--reload-rounds", type=click.IntRange(0), default=0, show_default=True,
              help="fs: after each chunk size's throughput rounds, this many load-only "
              "rounds per request count rereading one stored window (ratio with a 95 % "
              "interval; the disk-bound cells need 40 or so).")
@click.option("--dir", "directory", type=click.Path(file_okay=False, path_type=Path),
              default=Path(".bench-kvstore"), show_default=True,
              help="Scratch directory on the disk to measure (removed afterwards).")
@click.option("--samples", "samples_dir", type=click.Path(path_type=Path),
              default=None, show_default="../shared/data/kv-samples beside the checkout",
              help="Real KV samples (kv-samples.json + *.bin) for the codec comparison; "
              "a missing directory skips it.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("bench-results"), show_default=True,
              help="Where the JSON result and the PNG plots go.")
@click.option("--no-plots", is_flag=True, help="Skip the PNG plots.")
def bench(tiers: tuple[str, ...], quick: bool, chunk_kib: tuple[int, ...],
          total_mib: int | None, rounds: int | None, reload_rounds: int, directory: Path,
          samples_dir: Path | None, out_dir: Path, no_plots: bool) -> None:
    """Benchmark the tiers through vLLM's real TieringOffloadingManager.

    For fs, in the same run and on the same directory: our tier and vLLM's
    stock fs tier (store and load GB/s, 1 and 4 concurrent requests, chunk
    sizes 256 KiB to 8 MiB, scheduler steps from first lookup to HIT), disk
    O_DIRECT read/write, scheduler-thread p50/p99 per call, and the codecs on
    real bf16 KV (ratio, effective GB/s). Default run about 5 minutes,
    --quick about 1. Writes bench.json and PNG plots to --out.

    \b
    Examples:
      kvstore-tiers bench --quick
      kvstore-tiers bench --tier fs --tier redis --out docs/bench
      kvstore-tiers bench --chunk-kib 2048 --reload-rounds 40
    """
    require_extra("vllm", "torch")
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from kvstore_tiers.bench.plots import plot_all
    from kvstore_tiers.bench.runner import BenchPlan, print_tables, run, write_json
    from kvstore_tiers.samples import default_dir

    samples_dir = samples_dir or default_dir()
    samples = samples_dir if (samples_dir / "kv-samples.json").exists() else None
    plan = BenchPlan.quick() if quick else BenchPlan()
    plan.tiers = tuple(dict.fromkeys(tiers))
    plan.directory = directory
    plan.samples_dir = samples
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
    json_path = write_json(result, out_dir / "bench.json")
    console.print(f"result: {json_path}")
    if not no_plots:
        for p in plot_all(result, out_dir):
            console.print(f"plot: {p}")
    console.print(f"took {result['seconds']:.0f} s")
