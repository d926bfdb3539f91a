"""No secret (S3 keys, redis password, encryption key) in any log line or repr.

All logging is captured at DEBUG on the root logger, except botocore's and
urllib3's own DEBUG output, which prints request headers (including the
SigV4 ``Authorization`` header: key id and signature, never the secret) --
operators must not run those libraries at DEBUG in production
(docs/security.md).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest

from kvstore_tiers.admin.harness import build_harness, make_keys

from ..faults.common import rows_for
from ..servers import FAKE_KEY_ID, FAKE_SECRET

ENC_KEY = os.urandom(32).hex()
REDIS_PASSWORD = "redis-Pa55-do-not-log-9137"


def test_no_secret_in_logs_or_reprs(moto_endpoint: str, bucket: str, redis_server_factory: Any,
                                    monkeypatch: pytest.MonkeyPatch,
                                    caplog: pytest.LogCaptureFixture) -> None:
    srv = redis_server_factory(["--requirepass", REDIS_PASSWORD])
    monkeypatch.setenv("KVT_ENC_KEY", ENC_KEY)
    caplog.set_level(logging.DEBUG)
    for noisy in ("botocore", "aiobotocore", "urllib3", "boto3", "s3transfer"):
        caplog.set_level(logging.INFO, logger=noisy)
    tiers = [
        {"type": "s3", "bucket": bucket, "endpoint_url": moto_endpoint,
         "aws_access_key_id": FAKE_KEY_ID, "aws_secret_access_key": FAKE_SECRET,
         "encryption_key_env": "KVT_ENC_KEY"},
        {"type": "redis", "url": srv.url, "password": REDIS_PASSWORD,
         "encryption_key_env": "KVT_ENC_KEY"},
    ]
    h = build_harness(tiers, num_chunks=8, chunk_bytes=8192)
    texts: list[str] = []
    try:
        keys = make_keys(3, seed=61)
        ctx = h.store(keys, rows_for(keys, 8192))
        h.settle()
        h.finish_request(ctx)
        h.forget_primary()
        ctx = h.new_request()
        h.lookup_until_resolved(keys, ctx)
        h.settle()
        for t in h.tiers:
            texts += [repr(t), str(t), repr(t.config), str(t.config), repr(t.backend),
                      t.backend.describe(), repr(t.config.model_dump())]
    finally:
        h.shutdown()
    texts.append(caplog.text)
    texts += [r.getMessage() for r in caplog.records]
    blob = "\n".join(texts)
    assert "kvstore tier" in blob  # the capture worked
    for secret in (FAKE_SECRET, REDIS_PASSWORD, ENC_KEY, bytes.fromhex(ENC_KEY).hex().upper()):
        assert secret not in blob
