"""``kvstore-tiers bench --trace``: what the single-node and the fleet replay
(``--nodes``, ``tools/bench/fleet.py``) share, and the fleet's options."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

#: The options that only the fleet replay takes (their parameter names).
FLEET_ONLY = ("routings", "read_through", "affinity_blocks", "load_factor")
#: The single-node replay's options that mean nothing to the fleet.
NOT_FOR_FLEET = ("policies", "min_sightings", "tier_keys")
READ_THROUGH = {"off": (False,), "on": (True,), "both": (False, True)}


def remotes(tiers: tuple[str, ...], given: bool) -> tuple[str, ...]:
    """The remotes ``--tier`` names for the fleet (default: redis, then s3)."""
    from kvstore_tiers.tools.bench.fleet import REMOTES

    if not given:
        return REMOTES
    if "fs" in tiers:
        raise click.BadParameter("with --nodes, --tier picks the shared remote (redis or s3); "
                                 "every node has its own fs tier", param_hint="--tier")
    return tuple(dict.fromkeys(tiers))


def read_through_modes(mode: str | None) -> tuple[bool, ...]:
    """``--read-through`` as the runs it asks for (default: off, then on)."""
    return READ_THROUGH[mode or "both"]


def load_requests(trace_path: Path, n_requests: int | None) -> list[Any]:
    """The first ``n_requests`` requests of the trace; a usage error naming ``--trace``
    when it holds none or a line that is no request."""
    from kvstore_tiers.tools.bench import trace_file

    try:
        requests = trace_file.load(trace_path, n_requests)
    except trace_file.TraceError as exc:
        raise click.BadParameter(str(exc), param_hint="--trace") from None
    if not requests:
        raise click.BadParameter(f"{trace_path} holds no request", param_hint="--trace")
    return requests


def console() -> Any:
    """A rich console; wide tables are never squeezed when writing to a pipe or a file."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=220)


def run_to_json(key: str, path: Path, out: Any,
                run: Callable[[Callable[[str], None], Callable[[dict[str, Any]], None]],
                              dict[str, Any]]) -> dict[str, Any]:
    """``run(progress, partial)`` under ``key`` of a result with the machine and the
    code, rewritten to ``path`` after each of its runs (a long run keeps what it did)."""
    from kvstore_tiers.tools.bench.runner import code_info, machine_info, write_json

    result: dict[str, Any] = {"machine": machine_info(), "code": code_info(),
                              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    t0 = time.time()

    def partial(so_far: dict[str, Any]) -> None:
        write_json({**result, key: so_far, "complete": False}, path)

    result[key] = run(lambda msg: out.print(f"[{time.time() - t0:5.0f} s] {msg}"), partial)
    result["seconds"] = time.time() - t0
    result["complete"] = True
    return result


def fleet(trace_path: Path, nodes: int, remote_tiers: tuple[str, ...],
          routings: tuple[str, ...], read_through: tuple[bool, ...],
          affinity_blocks: int | None, load_factor: float | None, capacities: tuple[float, ...],
          n_requests: int | None, primary_blocks: int | None, chunk_kib: int | None,
          directory: Path, samples_dir: Path | None, out_dir: Path) -> None:
    """Run the fleet replay; fleet.json in ``out_dir`` and the tables."""
    from kvstore_tiers.tools.bench import fleet as fl
    from kvstore_tiers.tools.bench.runner import write_json
    from kvstore_tiers.tools.bench.tables import fleet_tables

    plan = fl.FleetPlan(trace=trace_path, nodes=nodes, remotes=remote_tiers,
                        read_through=read_through, primary_blocks=primary_blocks,
                        directory=directory, samples_dir=samples_dir)
    if routings:
        plan.routings = tuple(dict.fromkeys(routings))
    if capacities:
        plan.capacities = tuple(sorted(set(capacities)))
    knobs = {"affinity_blocks": affinity_blocks, "load_factor": load_factor}
    plan.knobs = dataclasses.replace(plan.knobs, **{k: v for k, v in knobs.items()
                                                    if v is not None})
    if chunk_kib is not None:
        plan.chunk_kib = chunk_kib
    requests = load_requests(trace_path, n_requests)
    out = console()
    path = out_dir / "fleet.json"
    result = run_to_json("fleet", path, out, lambda progress, partial: fl.run(
        plan, requests, progress, partial))
    for table in fleet_tables(result["fleet"]):
        out.print(table)
    out.print(f"result: {write_json(result, path)}")
    out.print(f"took {result['seconds']:.0f} s")
