"""``kvstore-tiers verify``: read objects back and check frames and checksums."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from kvstore_tiers.cli._common import (
    human_bytes,
    progress_on_stderr,
    store_errors,
    store_options,
    tier_title,
    tiers_from_options,
)


@click.command()
@store_options
@click.option("--sample", type=click.IntRange(1), default=None,
              help="Check a random sample of N objects instead of all.")
@click.option("--namespace", help="Only this namespace.")
@click.option("--delete", is_flag=True, help="Delete the corrupt objects found.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def verify(sample: int | None, namespace: str | None, delete: bool, as_json: bool,
           **store: Any) -> None:
    """Read every object (or --sample N) and check its frame and CRC-32C checksum.

    Each object is decoded exactly as a load decodes it: the header (magic,
    version, lengths), the key in the header against the key the object's
    name encodes, the namespace digest, the length, the payload decoded and
    its checksum compared. Exits 1 if any object is
    corrupt (after deleting them with --delete). Safe on a live store: a
    deleted object is a miss that vLLM recomputes.

    \b
    Example:
      kvstore-tiers verify --fs /mnt/kv --sample 1000
      kvstore-tiers verify --config tiers.json --delete
    """
    from rich.console import Console

    from kvstore_tiers.admin import open_store, verify_store

    tiers = tiers_from_options(**store)
    console = Console(stderr=as_json)
    results = []
    for tier in tiers:
        with store_errors(tier), open_store(tier) as backend, \
                progress_on_stderr(f"verifying {tier_title(tier)}") as update:
            rep = verify_store(backend, sample=sample, delete=delete, namespace=namespace,
                               progress=lambda i, n: update(i, n))
        results.append((tier, rep))
    if as_json:
        click.echo(json.dumps([{"tier": tier_title(t), **r.as_dict()} for t, r in results],
                              indent=2))
    else:
        for tier, r in results:
            colour = "red" if r.corrupt else "green"
            ratio = f"{r.raw_bytes / r.stored_bytes:.2f}x" if r.stored_bytes else "n/a"
            console.print(
                f"[bold {colour}]{tier_title(tier)}[/]: {r.checked} checked, {r.ok} ok, "
                f"{len(r.corrupt)} corrupt, {r.missing} vanished while checking; "
                f"{human_bytes(r.raw_bytes)} raw in {human_bytes(r.stored_bytes)} stored "
                f"({ratio}); codecs {dict(r.codecs)}", soft_wrap=True)
            for name, reason in r.corrupt:
                console.print(f"  corrupt: {name}: {reason}", soft_wrap=True, highlight=False)
            if r.deleted:
                console.print(f"  deleted {r.deleted} corrupt object(s)")
    if any(r.corrupt for _, r in results):
        sys.exit(1)
