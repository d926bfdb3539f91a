"""Startup: a wrong bucket, endpoint or credential fails with a message naming it;
secrets given in the config never show up anywhere; server quirks are probed."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from typing import Any

import boto3
import numpy as np
import pytest

from kvstore_tiers.backends.s3.config import as_config
from kvstore_tiers.errors import ConfigError

from ...faults.faultproxy import FaultProxy
from ...orphans import children_die_with_parent
from ...servers import FAKE_KEY_ID, FAKE_SECRET, free_port, run_moto, s3_client
from .s3_helpers import HIT, fetch, harness, make_keys, random_rows, round_trips

SECRET = "s3cr3t/Value+ThatMustNeverLeak0000000000"
TOKEN = "SessionTokenThatMustNeverLeak/abcdef0123456789"


def build_error(cfg: dict[str, Any]) -> str:
    """Build a manager with ``cfg``; return the startup error's message."""
    with pytest.raises(Exception) as info:
        harness(cfg)
    err: BaseException | None = info.value
    while err is not None and not isinstance(err, ConfigError):
        err = err.__cause__ or err.__context__
    assert isinstance(err, ConfigError), f"not a ConfigError: {info.value!r}"
    return str(err)


def test_missing_bucket_is_named(tier_config: Any, s3_endpoint: str) -> None:
    msg = build_error(tier_config(bucket="no-such-bucket-here"))
    assert "bucket 'no-such-bucket-here' does not exist" in msg
    assert s3_endpoint in msg


def test_create_bucket_on_request(tier_config: Any, s3: Any) -> None:
    name = f"kvt-new-{uuid.uuid4().hex[:12]}"
    h = harness(tier_config(bucket=name, create_bucket=True))
    try:
        s3.head_bucket(Bucket=name)
        keys, rows = make_keys(2, seed=20), random_rows(2, 16384, seed=20)
        h.store_all(keys, rows)
        assert h.tiers[0].counters.objects_stored == 2
    finally:
        h.shutdown()


def test_unreachable_endpoint_is_named(tier_config: Any) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    msg = build_error(tier_config(endpoint_url=dead))
    assert f"cannot reach endpoint {dead}" in msg


def test_invalid_keys_are_named(tier_config: Any) -> None:
    msg = build_error(tier_config(sse_kms_key_id="k1", aws_secret_access_key=SECRET))
    assert "sse_kms_key_id needs sse='aws:kms'" in msg and SECRET not in msg
    msg = build_error(tier_config(max_concurrency=0))
    assert "max_concurrency" in msg
    msg = build_error(tier_config(bukcet="x"))
    assert "bukcet" in msg and "unknown key" in msg


@pytest.fixture
def auth_server(request: pytest.FixtureRequest,
                s3_endpoint: str) -> Iterator[tuple[str, str, str, str]]:
    """A server that checks credentials: (url, bucket, key id, secret). RGW
    always does; moto does with a user of its IAM."""
    if request.node.callspec.params["s3_endpoint"] == "rgw":
        s3_client(s3_endpoint).create_bucket(Bucket="auth-bucket")
        yield s3_endpoint, "auth-bucket", FAKE_KEY_ID, FAKE_SECRET
        return
    # The first few requests run unauthenticated: enough to create a user.
    with run_moto({"INITIAL_NO_AUTH_ACTION_COUNT": "3"}) as url:
        iam = boto3.client("iam", endpoint_url=url, region_name="us-east-1",
                           aws_access_key_id="x", aws_secret_access_key="x")
        iam.create_user(UserName="kv")
        key = iam.create_access_key(UserName="kv")["AccessKey"]
        iam.put_user_policy(UserName="kv", PolicyName="all", PolicyDocument=json.dumps(
            {"Version": "2012-10-17",
             "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
        s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                          aws_access_key_id=key["AccessKeyId"],
                          aws_secret_access_key=key["SecretAccessKey"])
        s3.create_bucket(Bucket="auth-bucket")
        yield url, "auth-bucket", key["AccessKeyId"], key["SecretAccessKey"]


def test_bad_credentials_are_named(tier_config: Any, auth_server: Any) -> None:
    url, bucket, key_id, secret = auth_server
    cfg = tier_config(endpoint_url=url, bucket=bucket)
    msg = build_error({**cfg, "aws_access_key_id": "AKIAUNKNOWNKEY000000",
                       "aws_secret_access_key": SECRET})
    assert "credentials rejected" in msg and "InvalidAccessKeyId" in msg
    assert SECRET not in msg and "AKIAUNKNOWNKEY000000" not in msg
    msg = build_error({**cfg, "aws_access_key_id": key_id, "aws_secret_access_key": SECRET})
    assert "credentials rejected" in msg and "SignatureDoesNotMatch" in msg
    # The right keys work.
    round_trips({**cfg, "aws_access_key_id": key_id, "aws_secret_access_key": secret}, 2, 21)


@pytest.mark.moto_only(reason="made-up credentials, which only moto takes; the scrubbing it "
                       "tests is the same for every server")
def test_secrets_never_shown(tier_config: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.DEBUG, logger="kvstore_tiers")
    cfg = tier_config(aws_access_key_id="AKIASHOWNOWHERE00000", aws_secret_access_key=SECRET,
                      aws_session_token=TOKEN)
    h = harness(cfg)
    try:
        tier = h.tiers[0]
        keys, rows = make_keys(2, seed=22), random_rows(2, 16384, seed=22)
        h.store_all(keys, rows)
        shown = [repr(tier), tier.backend.describe(), repr(tier.backend.config),
                 str(tier.backend.config), caplog.text]
    finally:
        h.shutdown()
    shown.append(caplog.text)
    for text in shown:
        for secret in (SECRET, TOKEN, "AKIASHOWNOWHERE00000"):
            assert secret not in text
    assert "s3://" in shown[1]
    # Validation errors do not echo them either.
    with pytest.raises(ConfigError) as info:
        as_config({"type": "s3", "bucket": "bkt", "aws_secret_access_key": SECRET})
    assert SECRET not in str(info.value)


def test_server_without_conditional_put(tier_config: Any, s3_endpoint: str) -> None:
    proxy = FaultProxy(s3_endpoint)
    try:
        # A server that answers 501 to If-None-Match from the start: probed, plain PUT.
        proxy.error(501, "NotImplemented", methods={"PUT"}, header="If-None-Match")
        h = harness(tier_config(endpoint_url=proxy.url))
        try:
            assert "plain PUT" in h.tiers[0].backend.describe()
            keys, rows = make_keys(3, seed=23), random_rows(3, 16384, seed=23)
            h.store_all(keys, rows)
            h.forget_primary()
            results, got, _ = fetch(h, keys)
            assert results == [HIT] * 3 and np.array_equal(got, rows)
        finally:
            h.shutdown()
        # One that starts rejecting it at runtime: the tier falls back, stores still land.
        proxy.heal()
        h = harness(tier_config(endpoint_url=proxy.url))
        try:
            backend = h.tiers[0].backend
            assert backend.conditional_put
            proxy.error(501, "NotImplemented", methods={"PUT"}, header="If-None-Match")
            keys, rows = make_keys(3, seed=24), random_rows(3, 16384, seed=24)
            h.store_all(keys, rows)
            assert not backend.conditional_put
            assert h.tiers[0].counters.objects_stored == 3
        finally:
            h.shutdown()
    finally:
        proxy.close()


def test_the_harness_moto_picks_again_when_its_port_is_taken(monkeypatch) -> None:
    """The harness itself: moto_server finding its picked port taken (by any
    process, between the pick and its bind) is started on another."""
    import socket
    import urllib.request

    from ... import servers

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        picks = iter([busy])
        real = servers.free_low_port
        monkeypatch.setattr(servers, "free_low_port", lambda: next(picks, None) or real())
        with run_moto() as url:
            assert not url.endswith(f":{busy}")
            urllib.request.urlopen(f"{url}/moto-api/data.json", timeout=5).read()


def test_the_harness_rgw_daemons_die_with_the_test_process() -> None:
    """The harness itself: a daemon started the way RgwServer starts them
    (PR_SET_PDEATHSIG) is killed by the kernel when the test process that
    started it dies, even by SIGKILL, so an interrupted run leaves none."""
    _, children = children_die_with_parent(
        "import subprocess\n"
        "from kvstore_tiers.tools.children import die_with_parent\n"
        "p = subprocess.Popen(['sleep', '600'], preexec_fn=die_with_parent)\n")
    assert len(children) == 1
