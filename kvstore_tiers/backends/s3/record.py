"""The namespace record of the s3 tier, and keeping it out of lifecycle expiry.

``<prefix><namespace>/config.json`` holds the vLLM run config a namespace was
created with (what ``kvstore-tiers stats`` shows as model, dtype and layout).
It lives beside the blocks, so a lifecycle rule on the tier's prefix
(:func:`~kvstore_tiers.backends.s3.lifecycle.install_lifecycle`) covers it
too, and S3 has no filter that leaves one key out (Ceph RGW 16 drops the
object-size filters it does not know, keeping only the prefix). Instead the
record stays younger than any rule: the start-up probe writes it, and a
running tier rewrites it every ``namespace_record_refresh_s`` (at most 12 h;
a rule expires objects one day after their last write at the earliest), so
the record of a namespace in use never expires while its blocks do.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

from kvstore_tiers.backends.s3.config import S3Config, put_extra_args

logger = logging.getLogger(__name__)

#: Name of the record under ``<prefix><namespace>/``.
RECORD_NAME = "config.json"


def record_put_args(config: S3Config, namespace: str,
                    run_config: Mapping[str, Any]) -> dict[str, Any]:
    """PutObject arguments writing the record of ``namespace`` (with the tier's
    storage class and server-side encryption, like its blocks)."""
    return {
        "Bucket": config.bucket, "Key": f"{config.key_prefix}{namespace}/{RECORD_NAME}",
        "Body": json.dumps(run_config, indent=2, sort_keys=True).encode(),
        "ContentType": "application/json", **put_extra_args(config),
    }


async def keep_fresh(client: Callable[[], Any], args: Mapping[str, Any], interval_s: float,
                     warn: Callable[[str], None]) -> None:
    """Rewrite the record every ``interval_s`` seconds until cancelled.

    ``client()``: the backend's current aiobotocore client (None once closed:
    the loop ends). A failed rewrite is reported through ``warn`` and tried
    again at the next interval; it never reaches the data path.
    """
    while True:
        await asyncio.sleep(interval_s)
        c = client()
        if c is None:
            return
        try:
            await c.put_object(**args)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a transient server error: the next interval retries
            warn(f"s3 tier: rewriting the namespace record {args['Key']} failed "
                 f"({type(exc).__name__}); next try in {interval_s:g}s")
