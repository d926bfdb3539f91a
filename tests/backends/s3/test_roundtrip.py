"""Blocks go through vLLM's real manager to S3 (moto) and come back byte-exact."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest

from .s3_helpers import (
    HIT,
    MISS,
    SAMPLES,
    fetch,
    harness,
    make_keys,
    random_rows,
    sample_blocks,
)


def probes(backend: Any) -> int:
    """Existence-check requests sent so far: HEADs, or GETs of blocks nobody stored."""
    return backend.requests["HeadObject"] + backend.requests["GetObject"]


def test_random_rows_round_trip_and_layout(tier_config: Any, s3: Any, bucket: str) -> None:
    h = harness(tier_config(prefix="prod/kv"))
    try:
        keys, rows = make_keys(20, seed=1), random_rows(20, 16384, seed=1)
        h.store_all(keys, rows)
        tier = h.tiers[0]
        assert tier.counters.objects_stored == 20
        # One object per block under <prefix>/<namespace>/..., plus the namespace's config.json.
        listed = s3.list_objects_v2(Bucket=bucket, Prefix="prod/kv/")["Contents"]
        names = {o["Key"] for o in listed}
        ns = tier.namespace
        assert {f"prod/kv/{ns.object_name(k)}" for k in keys} <= names
        assert f"prod/kv/{ns.name}/config.json" in names
        assert not any(".kvstore-probe" in n for n in names)  # startup probe cleaned up

        h.forget_primary()
        results, got, _ = fetch(h, keys)
        assert results == [HIT] * 20
        assert np.array_equal(got, rows)
        assert tier.counters.objects_loaded == 20
    finally:
        h.shutdown()


@pytest.mark.skipif(not SAMPLES.exists(), reason="kv-samples not available")
def test_real_kv_blocks_round_trip_with_kvsplit(tier_config: Any) -> None:
    blocks = sample_blocks()
    n, row = blocks.shape
    keys = make_keys(n, seed=2)
    stored: dict[str, int] = {}
    for compression in ("auto", "none"):
        h = harness(tier_config(compression=compression, prefix=f"c-{compression}/"),
                    num_chunks=n, chunk_bytes=row)
        try:
            tier = h.tiers[0]
            h.store_all(keys, blocks)
            c = tier.counters
            assert c.raw_bytes_written == n * row
            stored[tier.codec_id.name.lower()] = c.stored_bytes_written
            h.forget_primary()
            results, got, _ = fetch(h, keys)
            assert results == [HIT] * n
            assert np.array_equal(got, blocks)
        finally:
            h.shutdown()
    # bf16 on a remote tier resolves auto -> kvsplit, and it pays: fewer bytes sent.
    assert set(stored) == {"kvsplit", "none"}
    assert stored["kvsplit"] < 0.8 * n * row < stored["none"]


def test_missing_objects_at_load_fail_only_those_keys(tier_config: Any, s3: Any,
                                                      bucket: str) -> None:
    h = harness(tier_config())
    try:
        keys, rows = make_keys(8, seed=3), random_rows(8, 16384, seed=3)
        h.store_all(keys, rows)
        tier = h.tiers[0]
        gone = [1, 4, 6]
        for i in gone:  # vanish behind the tier's back (expiry, gc, another admin)
            s3.delete_object(Bucket=bucket, Key="test/" + tier.namespace.object_name(keys[i]))
        h.forget_primary()
        # The presence index says HIT, so the promotion is attempted and partly fails.
        results, got, ctx = fetch(h, keys)
        assert [r == HIT for r in results] == [i not in gone for i in range(8)]
        assert np.array_equal(got, rows[[i for i in range(8) if i not in gone]])
        assert tier.counters.load_misses == 3
        assert tier.counters.load_failures == 0  # a missing object is a miss, not a failure
        # The same request keeps answering MISS for the failed keys (no livelock).
        again, _ = h.lookup_until_resolved([keys[i] for i in gone], ctx)
        assert again == [MISS] * 3
    finally:
        h.shutdown()


def test_corrupt_and_truncated_objects_are_misses_and_removed(
    tier_config: Any, s3: Any, bucket: str
) -> None:
    h = harness(tier_config(compression="none"))
    try:
        keys, rows = make_keys(6, seed=4), random_rows(6, 16384, seed=4)
        h.store_all(keys, rows)
        tier = h.tiers[0]
        obj = ["test/" + tier.namespace.object_name(k) for k in keys]
        body = [s3.get_object(Bucket=bucket, Key=o)["Body"].read() for o in obj]
        garbled = bytearray(body[0])
        garbled[-100] ^= 0xFF  # one flipped byte in the payload
        s3.put_object(Bucket=bucket, Key=obj[0], Body=bytes(garbled))
        s3.put_object(Bucket=bucket, Key=obj[1], Body=body[1][: len(body[1]) // 2])
        s3.put_object(Bucket=bucket, Key=obj[2], Body=body[3])  # another key's frame
        s3.put_object(Bucket=bucket, Key=obj[3], Body=b"not a frame at all")

        h.forget_primary()
        results, got, _ = fetch(h, keys)
        assert results == [MISS, MISS, MISS, MISS, HIT, HIT]
        assert np.array_equal(got, rows[4:])
        assert tier.counters.corrupt_objects == 4
        # The core removed the corrupt objects; a later request does not find them.
        remaining = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]}
        assert not set(obj[:4]) & remaining
        assert set(obj[4:]) <= remaining
        results, _, _ = fetch(h, keys[:4])
        assert results == [MISS] * 4
    finally:
        h.shutdown()


def test_two_engines_share_one_bucket(tier_config: Any) -> None:
    cfg = tier_config()
    writer, reader = harness(cfg), harness(cfg)
    other_model = harness(cfg, model="org/other-model")
    try:
        keys, rows = make_keys(12, seed=5), random_rows(12, 16384, seed=5)
        writer.store_all(keys, rows)
        backend = reader.tiers[0].backend
        before = Counter(backend.requests)
        results, got, _ = fetch(reader, keys)
        assert results == [HIT] * 12
        assert np.array_equal(got, rows)
        # The reader found them with one GET per looked-up block, whose body its load took
        # (lookup_prefetch_bytes): no HEAD, no second GET.
        sent = Counter(backend.requests) - before
        assert sent == Counter({"GetObject": 12}), sent
        # Same bucket and prefix, another model: another namespace, nothing shared.
        results, _, _ = fetch(other_model, keys)
        assert results == [MISS] * 12
        # The reader storing the same blocks rewrites nothing (If-None-Match: *).
        reader.forget_primary()
        reader.store_all(keys, rows)
        c = reader.tiers[0].counters
        assert (c.objects_stored, c.objects_skipped) == (0, 12)
    finally:
        for h in (writer, reader, other_model):
            h.shutdown()


def test_module_path_route(tier_config: Any) -> None:
    h = harness(tier_config(module_path="kvstore_tiers.tiers"))
    try:
        keys, rows = make_keys(3, seed=6), random_rows(3, 16384, seed=6)
        h.store_all(keys, rows)
        h.forget_primary()
        results, got, _ = fetch(h, keys)
        assert results == [HIT] * 3 and np.array_equal(got, rows)
        assert type(h.tiers[0]).__name__ == "S3Tier"
    finally:
        h.shutdown()


def test_absent_blocks_are_not_probed_again_within_negative_cache_s(tier_config: Any) -> None:
    """Requests sharing a prefix ask for the same absent blocks: one HEAD each,
    not one per request; a block this engine stores is not "absent" any more."""
    reader = harness(tier_config(negative_cache_s=3600))
    try:
        keys, rows = make_keys(6, seed=31), random_rows(6, 16384, seed=31)
        tier = reader.tiers[0]
        backend = tier.backend
        before = probes(backend)
        for _ in range(3):  # three requests with the same (absent) prefix
            results, _, _ = fetch(reader, keys)
            assert results == [MISS] * 6
        assert probes(backend) - before == 6
        reader.store_all(keys[:2], rows[:2])  # this engine stores two of them
        names = [tier.namespace.object_name(k) for k in keys]
        assert backend.exists_many(names) == [True, True] + [False] * 4
        assert probes(backend) - before == 8  # only the stored two re-probed
    finally:
        reader.shutdown()
