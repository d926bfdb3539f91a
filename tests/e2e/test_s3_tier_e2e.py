"""Two vLLM processes share an s3 tier: the second is served from it, with identical output.

Phase 1 and phase 2 are separate engine processes (tests/e2e/e2e_helpers.run)
pointed at one S3 server (moto, and a real Ceph RGW): phase 1 computes and
writes every full chunk to the bucket, phase 2 starts with empty GPU/CPU
caches and an empty presence index (so its lookups are HEADs), gets every
full chunk of its first prompt from S3, and generates the same tokens.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from e2e_helpers import DISTINCT_CHUNKS, assert_served_from_tier, run, tier_counters

pytest.importorskip("aiobotocore")
pytest.importorskip("moto")

from tests.servers import FAKE_KEY_ID, FAKE_SECRET, s3_client, s3_server_fixture

pytestmark = pytest.mark.engine
s3_endpoint = s3_server_fixture()


@pytest.fixture
def e2e_s3(s3_endpoint: str) -> tuple[str, str, Any]:
    """(endpoint, bucket, boto3 client): a fresh bucket on the test's S3 server."""
    client = s3_client(s3_endpoint)
    bucket = f"kv-e2e-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    return s3_endpoint, bucket, client


def test_second_process_is_served_from_s3(
        e2e_s3: tuple[str, str, Any], tiny_model: Path, tmp_path: Path) -> None:
    url, bucket, client = e2e_s3
    # Credentials in the tier config: each phase is its own process.
    tiers = [{"type": "s3", "bucket": bucket, "prefix": "e2e/", "endpoint_url": url,
              "aws_access_key_id": FAKE_KEY_ID, "aws_secret_access_key": FAKE_SECRET}]
    cold = run("s3-cold", tiny_model, tiers, tmp_path / "runs")
    assert cold["tier_classes"]["s3"].startswith("kvstore_tiers."), cold["tier_classes"]
    assert all(p["external_hit_tokens"] == 0 for p in cold["prompts"]), "tier was not empty"
    assert tier_counters(cold)["objects_stored"] == DISTINCT_CHUNKS
    listed = client.list_objects_v2(Bucket=bucket, Prefix="e2e/").get("Contents", [])
    assert len([o for o in listed if o["Key"].endswith(".kvf")]) == DISTINCT_CHUNKS

    warm = run("s3-warm", tiny_model, tiers, tmp_path / "runs")
    assert_served_from_tier(cold, warm, "s3")
