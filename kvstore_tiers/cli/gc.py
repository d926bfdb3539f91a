"""``kvstore-tiers gc``: delete objects by age or down to a size."""

from __future__ import annotations

import json
from typing import Any

import click

from kvstore_tiers.cli._common import (
    human_bytes,
    parse_age,
    parse_size,
    progress_on_stderr,
    store_errors,
    store_options,
    tier_title,
    tiers_from_options,
)


@click.command()
@store_options
@click.option("--max-age", help="Delete objects older than this (90s, 30m, 12h, 7d, 2w).")
@click.option("--max-bytes", help="Then delete the oldest until at most this many bytes "
              "remain (500M, 20G, 1TiB).")
@click.option("--namespace", help="Only this namespace.")
@click.option("--dry-run", is_flag=True, help="Only say what would be deleted.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def gc(max_age: str | None, max_bytes: str | None, namespace: str | None, dry_run: bool,
       as_json: bool, **store: Any) -> None:
    """Delete objects older than --max-age, then the oldest down to --max-bytes.

    Works on every backend, plugins included: the objects are listed, the
    doomed ones chosen by one policy, and deleted in batches of 1,000 (one
    request per batch where the backend deletes in batches: s3 DeleteObjects,
    a redis UNLINK pipeline). Age: fs mtime (last use when capped), s3
    LastModified (write time), redis frame created_ms. Safe while engines
    run: a deleted block is a miss that vLLM recomputes. A long run shows its
    progress on stderr.

    \b
    Example:
      kvstore-tiers gc --fs /mnt/kv --max-age 7d
      kvstore-tiers gc --config tiers.json --max-bytes 500G --dry-run
    """
    from kvstore_tiers.admin import gc as run_gc

    if max_age is None and max_bytes is None:
        raise click.UsageError("give --max-age and/or --max-bytes")
    age_s = parse_age(max_age) if max_age else None
    cap = parse_size(max_bytes) if max_bytes else None
    tiers = tiers_from_options(**store)
    results = []
    for tier in tiers:
        title = tier_title(tier)
        with store_errors(tier), progress_on_stderr(f"listing {title}") as update:
            results.append((tier, run_gc(
                tier, max_age_s=age_s, max_bytes=cap, namespace=namespace, dry_run=dry_run,
                progress=lambda phase, done, total, t=title: update(done, total, f"{phase} {t}"),
            )))
    if as_json:
        click.echo(json.dumps([{"tier": tier_title(t), **r.as_dict()} for t, r in results],
                              indent=2))
        return
    verb = "would delete" if dry_run else "deleted"
    for t, r in results:
        click.echo(f"{tier_title(t)}: scanned {r.scanned_objects} objects "
                   f"({human_bytes(r.scanned_bytes)}), {verb} {r.deleted_objects} "
                   f"({human_bytes(r.deleted_bytes)}), {human_bytes(r.remaining_bytes)} remain"
                   + (" [batched deletes]" if r.batched else ""))
