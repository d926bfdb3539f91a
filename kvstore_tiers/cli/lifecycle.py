"""``kvstore-tiers lifecycle``: show and install the S3 lifecycle rule expiring a tier's blocks."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import click

from kvstore_tiers.cli._common import store_errors, store_options, tier_title, tiers_from_options


def bucket_rules(tier: dict[str, Any]) -> list[dict[str, Any]]:
    """The lifecycle rules of the tier's bucket (empty when it has none)."""
    from botocore.exceptions import ClientError

    from kvstore_tiers.backends.s3.client import error_code, make_sync_client
    from kvstore_tiers.backends.s3.config import as_config

    cfg = as_config(tier)
    client = make_sync_client(cfg)
    try:
        return list(client.get_bucket_lifecycle_configuration(Bucket=cfg.bucket)["Rules"])
    except ClientError as exc:
        if error_code(exc)[0] == "NoSuchLifecycleConfiguration":
            return []
        raise
    finally:
        client.close()


@contextlib.contextmanager
def missing_bucket(tier: dict[str, Any]) -> Iterator[None]:
    """A bucket that does not exist: one line naming it and its endpoint (botocore's own
    text names the operation, not the bucket)."""
    from botocore.exceptions import ClientError

    from kvstore_tiers.backends.s3.client import error_code
    from kvstore_tiers.backends.s3.config import as_config

    try:
        yield
    except ClientError as exc:
        if error_code(exc)[0] != "NoSuchBucket":
            raise
        cfg = as_config(tier)
        raise click.ClickException(f"{tier_title(tier)}: bucket {cfg.bucket!r} does not exist "
                                   f"at {cfg.where}") from None


def _rule_row(rule: dict[str, Any]) -> dict[str, Any]:
    from kvstore_tiers.backends.s3.lifecycle import LIFECYCLE_RULE_PREFIX

    flt = rule.get("Filter") or {}
    prefix = flt.get("Prefix", (flt.get("And") or {}).get("Prefix", rule.get("Prefix", "")))
    exp = rule.get("Expiration") or {}
    return {"id": rule.get("ID", ""), "prefix": prefix, "status": rule.get("Status", ""),
            "expire_days": exp.get("Days"),
            "kvstore_tiers": str(rule.get("ID", "")).startswith(LIFECYCLE_RULE_PREFIX)}


@click.command()
@store_options
@click.option("--days", type=click.IntRange(1), default=None,
              help="Install (or replace) the rule expiring the tier's objects this many days "
              "after they were written. Without it, only show the rules.")
@click.option("--json", "as_json", is_flag=True, help="Print the rules as JSON.")
def lifecycle(days: int | None, as_json: bool, **store: Any) -> None:
    """Show an S3 tier's lifecycle rules, or install the one expiring its blocks.

    With --days N, installs the rule `kvstore-tiers-expiry:<prefix>`: objects
    under the tier's prefix expire N days after they were written (S3 counts
    from the write; a load does not extend it), and incomplete multipart
    uploads are aborted after a day. The bucket's other rules are kept. Then
    prints every rule of the bucket, ours marked. Needs
    s3:GetLifecycleConfiguration (and s3:PutLifecycleConfiguration to install).

    \b
    Example:
      kvstore-tiers lifecycle --s3 kv-cache --prefix prod/ --days 7
      kvstore-tiers lifecycle --config tiers.json --json
    """
    from rich.console import Console
    from rich.table import Table

    tiers = tiers_from_options(**store)
    out = []
    for tier in tiers:
        if tier.get("type") != "s3":
            raise click.UsageError(f"{tier_title(tier)}: lifecycle rules are an S3 feature")
        with store_errors(tier), missing_bucket(tier):
            if days is not None:
                from kvstore_tiers.backends.s3 import install_lifecycle

                install_lifecycle(tier, days)
            out.append((tier, [_rule_row(r) for r in bucket_rules(tier)]))
    if as_json:
        click.echo(json.dumps([{"tier": tier_title(t), "rules": rules} for t, rules in out],
                              indent=2))
        return
    console = Console()
    for tier, rules in out:
        table = Table(title=f"lifecycle rules of {tier_title(tier)}")
        for col in ("id", "prefix", "status", "expire after", "ours"):
            table.add_column(col)
        for r in rules:
            table.add_row(r["id"], r["prefix"] or "(whole bucket)", r["status"],
                          f"{r['expire_days']} d" if r["expire_days"] else "-",
                          "yes" if r["kvstore_tiers"] else "")
        console.print(table if rules else f"{tier_title(tier)}: no lifecycle rules")
