"""``bench --s3-bucket``: the user's bucket is measured under the given prefix only,
with credentials from the AWS chain, and what the bench wrote is removed."""

from __future__ import annotations

import pytest

boto3 = pytest.importorskip("boto3")
pytest.importorskip("vllm")

from kvstore_tiers.tools.bench import s3_bench  # noqa: E402


def test_users_bucket_is_measured_and_left_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    keys = s3_bench.FAKE_KEYS
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", keys["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", keys["aws_secret_access_key"])
    with s3_bench.moto_server() as endpoint:
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        client.create_bucket(Bucket="users-bucket")
        client.put_object(Bucket="users-bucket", Key="prod/keep.kvf", Body=b"mine")

        result = s3_bench.run(endpoint, "users-bucket", blocks=4, block_mib=1 / 16,
                              concurrency=4, rounds=1, lookup_blocks=4, prefix="bench/",
                              region="us-east-1")
        left = [o["Key"] for o in client.list_objects_v2(Bucket="users-bucket")
                .get("Contents", [])]
        client.close()
    assert result["server"] == f"{endpoint}, bucket users-bucket"
    assert result["gbps"]["tier_store"] > 0 and result["gbps"]["aio_get"] > 0
    cpu = result["cpu_s_per_gb"]  # this process's CPU per GB, tier and raw loop
    assert set(cpu) == {"tier_store", "tier_load", "tier_load_transfer", "aio_put", "aio_get"}
    assert all(v > 0 for v in cpu.values()), cpu
    assert result["lookup"]["other_engine_requests_per_block"] == 1.0
    assert left == ["prod/keep.kvf"]
