"""``kvstore-tiers gc``: delete objects by age or down to a size."""

from __future__ import annotations

import json

import click

from kvstore_tiers.cli._common import (
    human_bytes,
    parse_age,
    parse_size,
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
def gc(config_text: str | None, fs_root: str | None, redis_url: str | None,
       s3_bucket: str | None, endpoint_url: str | None, prefix: str | None,
       max_age: str | None, max_bytes: str | None, namespace: str | None, dry_run: bool,
       as_json: bool) -> None:
    """Delete objects older than --max-age, then the oldest down to --max-bytes.

    Works on fs, s3 (batched DeleteObjects) and redis (pipelined UNLINK), and on
    any plugin backend (one delete per object). Age: fs mtime (last use when
    capped), s3 LastModified (write time), redis frame created_ms. Safe while
    engines run: a deleted block is a miss that vLLM recomputes.

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
    tiers = tiers_from_options(config_text, fs_root, redis_url, s3_bucket, endpoint_url, prefix)
    results = [(t, run_gc(t, max_age_s=age_s, max_bytes=cap, namespace=namespace,
                          dry_run=dry_run)) for t in tiers]
    if as_json:
        click.echo(json.dumps([{"tier": tier_title(t), "dry_run": dry_run,
                                "scanned_objects": r.scanned_objects,
                                "scanned_bytes": r.scanned_bytes,
                                "deleted_objects": r.deleted_objects,
                                "deleted_bytes": r.deleted_bytes,
                                "remaining_bytes": r.remaining_bytes, "method": r.method}
                               for t, r in results], indent=2))
        return
    verb = "would delete" if dry_run else "deleted"
    for t, r in results:
        click.echo(f"{tier_title(t)}: scanned {r.scanned_objects} objects "
                   f"({human_bytes(r.scanned_bytes)}), {verb} {r.deleted_objects} "
                   f"({human_bytes(r.deleted_bytes)}), {human_bytes(r.remaining_bytes)} remain "
                   f"[{r.method}]")
