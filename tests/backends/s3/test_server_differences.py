"""What a real S3 server does differently from moto, on Ceph RGW 16 (and on
moto where the behaviour is S3's): encryption it does not confirm, keys it
rejects, lifecycle expiry, conditional PUT races, and TLS payload checksums.

Each start-up error names the key and keeps the server's own words.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import boto3
import pytest

from kvstore_tiers.admin.store import describe_run_config, read_run_config
from kvstore_tiers.backends.s3 import S3Backend, install_lifecycle
from kvstore_tiers.backends.s3.config import as_config
from kvstore_tiers.namespace import Namespace

from ...cli.conftest import invoke
from ...faults.faultproxy import FaultProxy
from ...servers import FAKE_KEY_ID, FAKE_SECRET, RgwServer
from .s3_helpers import harness, make_keys, random_rows, round_trips
from .test_startup import build_error

RGW_ONLY_TLS = "RGW's https endpoint: moto over plain http confirms what it is asked"


def _https(tier_config: Any, rgw: RgwServer, **kw: Any) -> dict[str, Any]:
    return tier_config(endpoint_url=rgw.tls_endpoint, ca_bundle=rgw.ca, **kw)


@pytest.mark.rgw_only(reason="moto answers sse with the x-amz-server-side-encryption header")
def test_sse_the_server_does_not_confirm_fails_start_up_naming_sse(
    tier_config: Any, rgw_server: RgwServer, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = _https(tier_config, rgw_server, sse="AES256")
    msg = build_error(cfg)
    assert "key 'sse'" in msg and "did not confirm" in msg and "sse_unverified_ok" in msg
    # `check` does not say OK either.
    out = invoke("check", "--config", json.dumps(cfg))
    assert out.exit_code == 1 and "key 'sse'" in out.output, out.output
    # The documented opt-out: starts, says so, and the blocks round-trip.
    round_trips({**cfg, "sse_unverified_ok": True}, 2, 51)
    assert "did not confirm sse='AES256'" in caplog.text


@pytest.mark.moto_only(reason="moto confirms sse; RGW 16 never does (test above)")
def test_sse_the_server_confirms_starts(tier_config: Any) -> None:
    h = harness(tier_config(sse="AES256"))
    try:
        assert "sse=AES256" in h.tiers[0].backend.describe()
    finally:
        h.shutdown()


def test_a_storage_class_the_server_lacks_is_named_with_its_words(tier_config: Any) -> None:
    msg = build_error(tier_config(storage_class="COLD"))
    assert "key 'storage_class'" in msg and "'COLD'" in msg
    assert "InvalidStorageClass" in msg or "InvalidArgument" in msg


@pytest.mark.rgw_only(reason="moto takes sse over plain http")
def test_sse_over_plain_http_names_sse_and_tls(tier_config: Any) -> None:
    msg = build_error(tier_config(sse="AES256"))
    assert "key 'sse'" in msg and "InvalidRequest" in msg and "TLS" in msg


@pytest.mark.rgw_only(reason=RGW_ONLY_TLS)
def test_kms_without_a_key_id_keeps_the_servers_message(
    tier_config: Any, rgw_server: RgwServer
) -> None:
    msg = build_error(_https(tier_config, rgw_server, sse="aws:kms"))
    assert "key 'sse'" in msg and "sse_kms_key_id" in msg
    assert "x-amz-server-side-encryption-aws-kms-key-id" in msg  # RGW's own words


@pytest.mark.rgw_only(reason=RGW_ONLY_TLS)
def test_with_both_keys_set_the_rejected_one_is_named(
    tier_config: Any, rgw_server: RgwServer, s3: Any, bucket: str
) -> None:
    msg = build_error(_https(tier_config, rgw_server, sse="AES256", sse_unverified_ok=True,
                             storage_class="COLD"))
    assert "key 'storage_class'" in msg and "key 'sse'" not in msg
    assert "Contents" not in s3.list_objects_v2(Bucket=bucket)  # no probe object left


def test_a_put_refused_for_another_reason_is_not_blamed_on_a_key(
    tier_config: Any, proxy: FaultProxy
) -> None:
    proxy.error(403, "AccessDenied", methods={"PUT"})  # a bucket policy denying writes
    msg = build_error(tier_config(endpoint_url=proxy.url, storage_class="STANDARD"))
    assert "cannot write under" in msg and "AccessDenied" in msg
    assert "key 'storage_class'" not in msg


@pytest.mark.rgw_only(reason="botocore's default checksums over https: RGW answers 411, "
                      "moto takes them")
def test_https_round_trip_needs_checksums_only_when_required(
    tier_config: Any, rgw_server: RgwServer, bucket: str
) -> None:
    # botocore's default (a streamed CRC32 trailer, no Content-Length) is refused ...
    plain = boto3.client("s3", endpoint_url=rgw_server.tls_endpoint, verify=rgw_server.ca,
                         region_name="us-east-1", aws_access_key_id=FAKE_KEY_ID,
                         aws_secret_access_key=FAKE_SECRET)
    with pytest.raises(Exception, match="MissingContentLength"):
        plain.put_object(Bucket=bucket, Key="x", Body=b"x" * 100)
    # ... the tier's clients send checksums only when required, and round-trip.
    round_trips(_https(tier_config, rgw_server), 3, 52)


def test_sixteen_conditional_writers_of_one_block_have_one_winner(tier_config: Any) -> None:
    ns = Namespace.from_run_config({"model_name": "org/model", "dtype": "bfloat16",
                                    "tokens_per_hash": 16, "layout": "race"})
    backend = S3Backend(as_config(tier_config()), ns)
    backend.open()
    try:
        assert backend.conditional_put
        name = f"{ns.name}/abc/abc{'0' * 61}_g0.kvf"
        start = threading.Barrier(16)
        won: list[bool | None] = [None] * 16

        def write(i: int) -> None:  # 16 PUTs with If-None-Match in flight at once
            start.wait()
            won[i] = backend.put(name, [f"writer {i:02d} ".encode() * 2000])

        threads = [threading.Thread(target=write, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert won.count(True) == 1 and won.count(False) == 15
        winner = won.index(True)
        assert bytes(backend.get(name)) == f"writer {winner:02d} ".encode() * 2000
    finally:
        backend.close()


@pytest.mark.rgw_only(reason="moto never expires objects; RGW's lifecycle does, a day lasting "
                      "rgw lc debug interval seconds")
def test_lifecycle_expires_the_blocks_but_not_the_namespace_record(
    tier_config: Any, rgw_server: RgwServer, s3: Any, bucket: str
) -> None:
    day = rgw_server.lc_debug_interval_s
    cfg = tier_config(namespace_record_refresh_s=day / 4)
    h = harness(cfg)
    try:
        backend = h.tiers[0].backend
        ns = backend.namespace.name
        h.store_all(make_keys(4, seed=53), random_rows(4, 16384, seed=53))
        install_lifecycle(cfg, days=1)
        deadline = time.monotonic() + 20 * day
        while list(backend.iter_objects()):
            assert time.monotonic() < deadline, "RGW did not expire the blocks"
            rgw_server.admin("lc", "process")
            time.sleep(day / 5)
        # Blocks written with the record are gone; the record of the namespace in use is not.
        left = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])}
        assert left == {f"test/{ns}/config.json"}
        shown = describe_run_config(read_run_config(backend, ns))
        assert shown["model"] == "org/model" and shown["dtype"] == "bfloat16"
    finally:
        h.shutdown()
