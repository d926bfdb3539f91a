"""``kvstore-tiers stats``: objects, bytes, namespaces and ages of a store."""

from __future__ import annotations

import json
import time
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
@click.option("--namespace", help="Only this namespace (directory / key prefix).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def stats(namespace: str | None, as_json: bool, **store: Any) -> None:
    """Objects, bytes and namespaces of a store, and an age histogram.

    Each namespace is one model/dtype/parallel layout (vLLM's run config,
    read from the namespace's config.json on fs and s3; redis keeps none).
    Ages are from the object time: fs mtime (last use when the tier is
    capped), s3 LastModified (write), redis frame created_ms (write).
    A long listing shows its progress on stderr.

    \b
    Example:
      kvstore-tiers stats --fs /mnt/kv
      kvstore-tiers stats --redis redis://127.0.0.1:6379/0 --json
      kvstore-tiers stats --s3 kv-cache --region eu-west-1 --profile ops
    """
    from rich.console import Console
    from rich.table import Table

    from kvstore_tiers.admin import collect_stats, open_store

    tiers = tiers_from_options(**store)
    out = []
    for tier in tiers:
        with store_errors(tier), open_store(tier) as backend, \
                progress_on_stderr(f"listing {tier_title(tier)}") as update:
            out.append((tier, collect_stats(backend, namespace, progress=update)))
    if as_json:
        click.echo(json.dumps([{"tier": tier_title(t), **s.as_dict()} for t, s in out], indent=2))
        return
    console = Console()
    now = time.time()
    for tier, s in out:
        console.print(f"[bold]{tier_title(tier)}[/]: {s.objects} objects, "
                      f"{human_bytes(s.bytes)} in {len(s.namespaces)} namespace(s)")
        t = Table(title="namespaces")
        described = s.as_dict()["namespaces"]
        # The model identity column only where a namespace carries one (JSON: always).
        with_identity = any(d["identity"] != "off" for d in described.values())
        cols = ("namespace", "model", "dtype", "layout", *(("identity",) * with_identity),
                "objects", "bytes", "newest")
        for col in cols:
            t.add_column(col, justify="right" if col in ("objects", "bytes") else "left")
        for name, ns in sorted(s.namespaces.items()):
            d = described[name]
            age = f"{(now - ns.newest) / 60:.1f} min ago" if ns.newest else "?"
            t.add_row(name, d["model"], d["dtype"], d["layout"],
                      *((d["identity"],) * with_identity), str(ns.objects),
                      human_bytes(ns.bytes), age)
        console.print(t)
        h = Table(title="age histogram")
        for col in ("age", "objects", "bytes", ""):
            h.add_column(col, justify="right" if col else "left")
        peak = max((o for o, _ in s.ages.values()), default=0) or 1
        for label, (objs, nbytes) in s.ages.items():
            h.add_row(label, str(objs), human_bytes(nbytes), "#" * round(30 * objs / peak))
        console.print(h)
