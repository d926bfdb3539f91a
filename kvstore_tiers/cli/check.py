"""``kvstore-tiers check``: validate a tier config, connect, round-trip one block."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

import click

from kvstore_tiers.cli._common import (
    parse_size,
    require_extra,
    store_options,
    tier_title,
    tiers_from_options,
)


@click.command()
@store_options
@click.option("--block-size", "block_size", default="256K", show_default=True,
              help="Size of the test block (e.g. 256K, 2M).")
@click.option("--timeout", "timeout_s", default=30.0, show_default=True,
              help="Seconds allowed for the round trip.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def check(block_size: str, timeout_s: float, as_json: bool, **store: Any) -> None:
    """Validate every key of each tier, connect, and round-trip one block byte-exact.

    The tier is built by vLLM's own factory inside vLLM's real
    TieringOffloadingManager, exactly as `vllm serve` would build it: one
    engine stores a block, a second one (a restart) finds it in the store and
    loads it back (for a store whose objects go with their engine, such as the
    memory plugin's, the first engine loads it back itself). Exits 1 if any
    tier fails, with a message naming the wrong key, endpoint or credential.

    The check leaves no trace: it works in a namespace of its own (a random
    namespace_salt) and removes it afterwards, its run config and
    directories included.

    \b
    Example:
      kvstore-tiers check --config '{"type": "fs", "root_dir": "/mnt/kv"}'
      kvstore-tiers check --config kv-transfer-config.json
    """
    from rich.console import Console
    from rich.table import Table

    from kvstore_tiers.admin import check_tier

    tiers = tiers_from_options(**store)
    require_extra("vllm", "torch")
    with _store_warnings_only():
        reports = [check_tier(t, block_bytes=parse_size(block_size), timeout_s=timeout_s)
                   for t in tiers]
    if as_json:
        click.echo(json.dumps([r.as_dict() for r in reports], indent=2))
    else:
        console = Console()
        for tier, r in zip(tiers, reports, strict=True):
            if not r.ok:
                console.print(f"[bold red]FAIL[/] {tier_title(tier)}: {r.error}", soft_wrap=True)
                continue
            t = Table(title=f"[green]OK[/] {tier_title(tier)}", show_header=False)
            t.add_column(style="bold")
            t.add_column()
            t.add_row("backend", r.backend)
            t.add_row("namespace", r.namespace)
            t.add_row("codec", r.codec)
            t.add_row("O_DIRECT", "n/a" if r.o_direct is None else ("on" if r.o_direct else "off"))
            t.add_row("round trip", f"{r.block_bytes} B block byte-exact; stored as "
                      f"{r.stored_bytes} B")
            t.add_row("store latency", f"{r.store_ms:.1f} ms (cascade primary -> tier)")
            t.add_row("load latency", f"{r.load_ms:.1f} ms (first lookup -> HIT in primary)")
            t.add_row("read back by", "a second engine (a restart)" if r.restarted else
                      "the same engine: this store's objects do not outlive it")
            console.print(t)
    if not all(r.ok for r in reports):
        sys.exit(1)


@contextlib.contextmanager
def _store_warnings_only() -> Iterator[None]:
    """While a check runs: vLLM's own start-up lines (its Triton notice, ...) say nothing
    about the store, so only its errors show unless ``VLLM_LOGGING_LEVEL`` asks for more;
    our warnings about the store (a Redis without maxmemory, ...) stay on stderr.

    Everything is put back on return: the variable (engines a caller starts later copy
    the environment), the ``vllm`` and ``kvstore_tiers`` loggers' levels and handlers.
    A ``VLLM_LOGGING_LEVEL`` that names no level is a usage error naming the variable.
    """
    from kvstore_tiers.log import log_to_stderr

    env_before = os.environ.get("VLLM_LOGGING_LEVEL")
    vllm_log, ours = logging.getLogger("vllm"), logging.getLogger("kvstore_tiers")
    levels_before = (vllm_log.level, ours.level)
    handlers_before = list(ours.handlers)
    level = (env_before or "ERROR").upper()
    try:
        # Some lines are logged before vLLM configures its logger: the level of "vllm"
        # holds them; the variable covers vLLM's own configuration when it imports.
        vllm_log.setLevel(level)
    except ValueError:
        raise click.UsageError(
            f"VLLM_LOGGING_LEVEL={env_before!r} is not a logging level "
            "(DEBUG, INFO, WARNING, ERROR, CRITICAL)") from None
    os.environ["VLLM_LOGGING_LEVEL"] = level
    try:
        log_to_stderr(logging.WARNING)
        yield
    finally:
        if env_before is None:
            os.environ.pop("VLLM_LOGGING_LEVEL", None)
        else:
            os.environ["VLLM_LOGGING_LEVEL"] = env_before
        vllm_log.setLevel(levels_before[0])
        ours.setLevel(levels_before[1])
        ours.handlers[:] = handlers_before
