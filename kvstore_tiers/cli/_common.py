"""Options and helpers shared by the admin commands (check, stats, verify, gc).

A store is named either by ``--config`` (the same JSON a user gives vLLM: a
tier dict, a list, a kv_connector_extra_config or a whole kv-transfer-config,
inline or as a file) or by one shortcut (``--fs DIR``, ``--redis URL``,
``--s3 BUCKET`` with ``--endpoint-url``/``--prefix``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeVar

import click

from kvstore_tiers.errors import ConfigError

F = TypeVar("F", bound=Callable[..., Any])

_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20,
               "mb": 10**6, "mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30,
               "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}
_AGE_UNITS = {"": 1, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_size(text: str) -> int:
    """``"10G"`` -> bytes. Binary for K/M/G/T and KiB.., decimal for KB/MB/GB/TB."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise click.BadParameter(f"{text!r} is not a size (e.g. 500M, 20G, 1.5TiB)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def parse_age(text: str) -> float:
    """``"7d"`` -> seconds (s, m/min, h, d, w; a bare number is seconds)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _AGE_UNITS:
        raise click.BadParameter(f"{text!r} is not a duration (e.g. 90s, 30m, 12h, 7d)")
    return float(m.group(1)) * _AGE_UNITS[m.group(2).lower()]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def store_options(fn: F) -> F:
    """Add --config / --fs / --redis / --s3 (+ --endpoint-url, --prefix) to a command."""
    opts = [
        click.option("--config", "config_text", metavar="JSON|FILE",
                     help="secondary_tiers as given to vLLM: a tier dict, a list, or a "
                     "kv-transfer-config / kv_connector_extra_config containing it."),
        click.option("--fs", "fs_root", metavar="DIR", help="Shortcut: an fs tier at DIR."),
        click.option("--redis", "redis_url", metavar="URL",
                     help="Shortcut: a redis tier at URL (redis://host:port/db)."),
        click.option("--s3", "s3_bucket", metavar="BUCKET", help="Shortcut: an s3 tier bucket."),
        click.option("--endpoint-url", help="With --s3: S3-compatible endpoint (MinIO...)."),
        click.option("--prefix", default=None, help="With --s3: key prefix of the tier."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def tiers_from_options(config_text: str | None, fs_root: str | None, redis_url: str | None,
                       s3_bucket: str | None, endpoint_url: str | None,
                       prefix: str | None) -> list[dict[str, Any]]:
    """The tier dicts named by :func:`store_options` (exactly one way must be used)."""
    from kvstore_tiers.admin import parse_tiers

    given = [x for x in (config_text, fs_root, redis_url, s3_bucket) if x]
    if len(given) != 1:
        raise click.UsageError("name the store with exactly one of --config, --fs, --redis, --s3")
    if config_text:
        try:
            return parse_tiers(config_text)
        except ConfigError as exc:
            raise click.BadParameter(str(exc), param_hint="--config") from None
    if fs_root:
        return [{"type": "fs", "root_dir": fs_root}]
    if redis_url:
        return [{"type": "redis", "url": redis_url}]
    tier: dict[str, Any] = {"type": "s3", "bucket": s3_bucket}
    if endpoint_url:
        tier["endpoint_url"] = endpoint_url
    if prefix:
        tier["prefix"] = prefix
    return [tier]


def tier_title(tier: dict[str, Any]) -> str:
    """Short, secret-free name of a tier dict for headings."""
    where = tier.get("root_dir") or tier.get("bucket") or tier.get("url") or tier.get("nodes")
    if tier.get("type") == "redis" and isinstance(where, str):
        from kvstore_tiers.redact import redact_url

        where = redact_url(where)
    return f"{tier.get('type')} {where}" if where else str(tier.get("type"))
