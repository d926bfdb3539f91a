"""AES-GCM encryption over S3: two tenants with different keys share one bucket and prefix."""

from __future__ import annotations

import os
from typing import Any

import pytest

pytest.importorskip("cryptography")
pytest.importorskip("aiobotocore")

from kvstore_tiers.admin.harness import make_keys

from ..faults.common import HIT, MISS, Driver, rows_for
from ..servers import FAKE_KEY_ID, FAKE_SECRET


def _tier(endpoint: str, bucket: str, env: str) -> list[dict[str, Any]]:
    return [{"type": "s3", "bucket": bucket, "prefix": "shared/", "endpoint_url": endpoint,
             "aws_access_key_id": FAKE_KEY_ID, "aws_secret_access_key": FAKE_SECRET,
             "encryption_key_env": env, "connect_timeout_s": 1.0, "read_timeout_s": 5.0}]


def _objects(s3: Any, bucket: str) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for o in page.get("Contents", ()):
            out[o["Key"]] = s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
    return out


def test_tenants_sharing_a_bucket(moto_endpoint: str, bucket: str, s3: Any,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TENANT_A_S3_KEY", os.urandom(32).hex())
    monkeypatch.setenv("TENANT_B_S3_KEY", os.urandom(32).hex())
    a = Driver("s3+aes", _tier(moto_endpoint, bucket, "TENANT_A_S3_KEY"))
    b = Driver("s3+aes", _tier(moto_endpoint, bucket, "TENANT_B_S3_KEY"))
    try:
        assert a.tier.encrypted and b.tier.encrypted
        assert a.tier.namespace.name != b.tier.namespace.name
        # Each tenant stores its own blocks; both also store the same block keys
        # with different contents (same prompt prefix, different tenants).
        own_a, own_b, common = make_keys(6, seed=61), make_keys(6, seed=62), make_keys(3, seed=63)
        rows_a = rows_for(own_a + common, a.row_bytes)
        rows_b = rows_for(own_b + common, b.row_bytes)
        rows_b[-3:] ^= 0x5A  # B's version of the common blocks differs from A's
        a.store(own_a + common, rows_a)
        b.store(own_b + common, rows_b)

        # Each round-trips its own blocks byte-exact (Driver checks every HIT's bytes).
        for t, keys in ((a, own_a + common), (b, own_b + common)):
            t.forget_primary()
            assert t.fetch(keys) == [HIT] * len(keys)
        # Neither reads the other's: misses, never garbage.
        a.expected.update(b.expected)
        b.expected.update(a.expected)
        for t, theirs in ((a, own_b), (b, own_a)):
            t.forget_primary()
            assert t.fetch(theirs) == [MISS] * len(theirs)
        # A's ciphertext planted under B's object names: still a miss (corrupt), not A's rows.
        for k in own_a[:3]:
            frame = bytes(a.tier.backend.get(a.tier.namespace.object_name(k)))
            b.tier.backend.put(b.tier.namespace.object_name(k), [frame])
        b.score.fault("foreign_ciphertext", 3)
        b.forget_primary()
        assert b.fetch(own_a[:3]) == [MISS] * 3
        assert b.tier.counters.corrupt_objects == 3
        # The common blocks still come back as each tenant's own version.
        a.expected.update({k: r.tobytes() for k, r in zip(own_a + common, rows_a, strict=True)})
        b.expected.update({k: r.tobytes() for k, r in zip(own_b + common, rows_b, strict=True)})
        for t, keys in ((a, common), (b, common)):
            t.forget_primary()
            assert t.fetch(keys) == [HIT] * 3
        assert a.score.wrong_bytes == 0 and b.score.wrong_bytes == 0

        # What sits in the bucket: one object per stored block per tenant, no plaintext.
        objects = _objects(s3, bucket)
        frames = {k: v for k, v in objects.items() if k.endswith(".kvf")}
        assert len(frames) == 2 * 9
        for rows in (rows_a, rows_b):
            for row in rows:
                probes = [row[i : i + 64].tobytes() for i in (0, len(row) // 2, len(row) - 64)]
                for key, body in objects.items():
                    assert not any(p in body for p in probes), f"plaintext row bytes in {key}"
    finally:
        leaked = b.close() + a.close()  # the last close also counts leftover threads
    assert leaked == 0  # no pinned primary slots, jobs or tier threads left
