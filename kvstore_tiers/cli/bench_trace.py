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
#: The price options of ``--cost`` (their parameter names).
PRICES = ("price_put", "price_get", "price_delete", "price_gb_month")
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


def prices(cost: bool, ctx: click.Context, tiers: tuple[str, ...]) -> Any:
    """The :class:`~kvstore_tiers.tools.bench.cost.S3Prices` of ``--cost`` and the
    ``--price-*`` options given (None without ``--cost``); a usage error when the
    replay has no s3 tier to price or a price comes without ``--cost``."""
    from kvstore_tiers.tools.bench.cost import S3Prices

    given = {n: ctx.params[n] for n in PRICES if ctx.params.get(n) is not None}
    if not cost:
        if given:
            raise click.UsageError("the --price-* options only apply to --cost")
        return None
    if "s3" not in tiers:
        raise click.UsageError("--cost prices the s3 tier's requests: add --tier s3")
    names = {"price_put": "put_per_1k", "price_get": "get_per_1k",
             "price_delete": "delete_per_1k", "price_gb_month": "gb_month"}
    out = S3Prices(**{names[n]: v for n, v in given.items()})
    return out if not given else dataclasses.replace(
        out, source="prices given on the command line, defaults for the rest: " + out.source)


def add_trace_costs(result: dict[str, Any], prices: Any) -> list[tuple[str, dict[str, Any]]]:
    """Price every s3 row of a ``--trace`` result (``row["cost"]``); (label, cost) each."""
    from kvstore_tiers.tools.bench.cost import block_cost
    from kvstore_tiers.tools.bench.trace import SCALES

    out = []
    for row in result["rows"]:
        if row["tier"] != "s3":
            continue
        rp = row["replay"]
        row["cost"] = block_cost(row["requests_by_kind"], row["objects_written"],
                                 rp["tier_blocks_hit"], rp["tokens_requested"],
                                 rp["tier_tokens_hit"], row["stored_bytes_written"], prices,
                                 SCALES)
        out.append((f"s3, {row['policy']}", row["cost"]))
    return out


def add_fleet_costs(result: dict[str, Any], prices: Any,
                    prompt_tokens: int) -> list[tuple[str, dict[str, Any]]]:
    """Price every run of a fleet result on s3 (``row["cost"]``, the nodes' requests
    together); tokens served count 512 per block loaded from the remote."""
    from collections import Counter

    from kvstore_tiers.tools.bench.cost import block_cost
    from kvstore_tiers.tools.bench.trace import SCALES
    from kvstore_tiers.tools.bench.trace_file import BLOCK_TOKENS

    out = []
    for row in result["rows"]:
        if row["remote"] != "s3":
            continue
        requests: Counter[str] = Counter()
        for node in row["per_node"]:
            requests.update(node["requests_by_kind"] or {})
        served = row["hits"].get("remote", 0)
        row["cost"] = block_cost(requests, row["remote_puts"]["objects"], served, prompt_tokens,
                                 served * BLOCK_TOKENS, row["remote_puts"]["bytes"], prices,
                                 SCALES)
        out.append((f"s3, {result['nodes']} nodes, {row['routing']}, read-through "
                    f"{'on' if row['read_through'] else 'off'}", row["cost"]))
    return out


def print_costs(out: Any, costs: list[tuple[str, dict[str, Any]]]) -> None:
    """The cost table and one headline line per priced run."""
    from kvstore_tiers.tools.bench.cost import headline
    from kvstore_tiers.tools.bench.tables import cost_table

    if not costs:
        return
    out.print(cost_table(costs))
    for label, c in costs:
        out.print(headline(c, label))


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
          directory: Path, samples_dir: Path | None, out_dir: Path, prices: Any = None
          ) -> None:
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
    if prices is not None:
        print_costs(out, add_fleet_costs(result["fleet"], prices,
                                         sum(r.input_length for r in requests)))
    out.print(f"result: {write_json(result, path)}")
    out.print(f"took {result['seconds']:.0f} s")
