"""Bucket-side administration of the s3 tier: listing and lifecycle expiry."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from kvstore_tiers.backends.base import ObjectInfo
from kvstore_tiers.backends.s3.client import error_code, make_sync_client
from kvstore_tiers.backends.s3.config import SUFFIX, S3Config, as_config
from kvstore_tiers.errors import ConfigError

#: Lifecycle rule id installed by :func:`install_lifecycle` (one per prefix).
LIFECYCLE_RULE_PREFIX = "kvstore-tiers-expiry"


def iter_objects(config: S3Config, prefix: str = "", client: Any = None) -> Iterator[ObjectInfo]:
    """Every block object under ``<config.prefix><prefix>`` (names without config.prefix)."""
    client = client or make_sync_client(config)
    base = config.key_prefix
    paginator = client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=config.bucket, Prefix=base + prefix):
        for obj in page.get("Contents", ()):
            key: str = obj["Key"]
            if not key.endswith(SUFFIX):
                continue
            yield ObjectInfo(key[len(base):], int(obj["Size"]),
                             obj["LastModified"].timestamp())


def install_lifecycle(config: S3Config | Mapping[str, Any], days: int) -> dict[str, Any]:
    """Install (or replace) an S3 lifecycle rule expiring this prefix's objects.

    Objects under ``prefix`` expire ``days`` days after they were written
    (S3 counts from creation; a load does not extend it). Incomplete
    multipart uploads under the prefix are aborted after one day. Other
    rules of the bucket are kept; our rule is identified by its id
    ``kvstore-tiers-expiry:<prefix>``. Returns the rule installed.
    Needs ``s3:GetLifecycleConfiguration`` and ``s3:PutLifecycleConfiguration``.
    """
    from botocore.exceptions import ClientError

    cfg = as_config(config)
    if days < 1:
        raise ConfigError("s3 lifecycle: days must be >= 1")
    client = make_sync_client(cfg)
    rule_id = f"{LIFECYCLE_RULE_PREFIX}:{cfg.key_prefix or '*'}"[:255]
    try:
        rules = client.get_bucket_lifecycle_configuration(Bucket=cfg.bucket).get("Rules", [])
    except ClientError as exc:
        code, _ = error_code(exc)
        if code != "NoSuchLifecycleConfiguration":
            raise
        rules = []
    rule = {
        "ID": rule_id,
        "Filter": {"Prefix": cfg.key_prefix},
        "Status": "Enabled",
        "Expiration": {"Days": int(days)},
        "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 1},
    }
    rules = [r for r in rules if r.get("ID") != rule_id] + [rule]
    client.put_bucket_lifecycle_configuration(
        Bucket=cfg.bucket, LifecycleConfiguration={"Rules": rules}
    )
    return rule
