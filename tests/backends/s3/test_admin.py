"""Capacity administration of an s3 tier: listing, lifecycle expiry, garbage collection."""

from __future__ import annotations

import time
from typing import Any

from kvstore_tiers.admin import gc_store
from kvstore_tiers.backends.s3 import install_lifecycle

from .s3_helpers import MISS, fetch, harness, make_keys, random_rows


def test_lifecycle_rule_installed_once_and_other_rules_kept(
    tier_config: Any, s3: Any, bucket: str
) -> None:
    other = {"ID": "someone-elses", "Filter": {"Prefix": "logs/"}, "Status": "Enabled",
             "Expiration": {"Days": 30}}
    s3.put_bucket_lifecycle_configuration(Bucket=bucket,
                                          LifecycleConfiguration={"Rules": [other]})
    cfg = tier_config(prefix="prod")
    install_lifecycle(cfg, days=3)
    install_lifecycle(cfg, days=7)  # replaces ours, does not add a second rule
    rules = s3.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"]
    ours = [r for r in rules if r["ID"].startswith("kvstore-tiers-expiry")]
    assert len(ours) == 1
    assert ours[0]["Expiration"]["Days"] == 7
    assert ours[0]["Filter"]["Prefix"] == "prod/"
    assert any(r["ID"] == "someone-elses" for r in rules)


def test_gc_by_age_and_by_size(tier_config: Any, s3: Any, bucket: str) -> None:
    cfg = tier_config(compression="none")
    h = harness(cfg)
    try:
        backend = h.tiers[0].backend
        old, old_rows = make_keys(6, seed=30), random_rows(6, 16384, seed=30)
        h.store_all(old, old_rows)
        listed = list(backend.iter_objects())
        assert len(listed) == 6 and all(o.size > 16384 for o in listed)
        size = listed[0].size

        def gc(_cfg: Any, **kw: Any) -> Any:  # gc plans over iter_objects (LastModified)
            return gc_store(backend, namespace=backend.namespace.name, **kw)

        # Nothing is older than an hour: age gc keeps everything.
        assert gc(cfg, max_age_s=3600).deleted_objects == 0
        # Seen from two hours later, all six are too old (dry run first).
        later = time.time() + 7200
        dry = gc(cfg, max_age_s=3600, now=later, dry_run=True)
        assert (dry.scanned_objects, dry.deleted_objects) == (6, 6)
        assert len(list(backend.iter_objects())) == 6

        # Size cap: down to 4 objects' worth.
        res = gc(cfg, max_bytes=4 * size)
        assert (res.deleted_objects, res.remaining_bytes) == (2, 4 * size)
        assert len(list(backend.iter_objects())) == 4

        res = gc(cfg, max_age_s=3600, now=later)
        assert res.deleted_objects == 4 and not list(backend.iter_objects())
        # What gc removed is a miss for a new engine, never an error.
        other = harness(cfg)
        try:
            results, _, _ = fetch(other, old)
            assert results == [MISS] * 6
        finally:
            other.shutdown()
        # The namespace description is not a block: gc leaves it.
        keys = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]}
        assert keys == {f"test/{backend.namespace.name}/config.json"}
    finally:
        h.shutdown()
