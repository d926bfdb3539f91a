"""A secret inside a tier's config gets one start-up warning naming the key and
the way out, never the value (vLLM's server logs the whole --kv-transfer-config);
a config without one gets none. Real redis-server and moto S3 servers."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest

from kvstore_tiers.admin.harness import make_keys
from kvstore_tiers.backends.redis import RedisConfig
from kvstore_tiers.errors import ConfigError

from ..faults.common import rows_for
from ..servers import FAKE_KEY_ID, FAKE_SECRET

PW = "inline-Pa55-warn-4c2e"
ROW = 4096


def _secret_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "a secret" in r.getMessage()]


def _run(harness_factory: Callable[..., Any], tier: dict[str, Any]) -> None:
    """Start a tier and round-trip blocks through it (a start-up and some steps)."""
    h = harness_factory([tier], num_chunks=8, chunk_bytes=ROW)
    keys = make_keys(3, seed=17)
    h.store_all(keys, rows_for(keys, ROW))
    h.forget_primary()
    ctx = h.new_request()
    h.lookup_until_resolved(keys, ctx)
    h.settle()
    h.finish_request(ctx)
    assert h.tiers[0].counters.objects_loaded == 3


def test_a_redis_password_in_the_config_is_warned_once(
        redis_server_factory: Any, harness_factory: Callable[..., Any],
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    srv = redis_server_factory(["--requirepass", PW])
    caplog.set_level(logging.DEBUG)
    _run(harness_factory, {"type": "redis", "url": f"redis://:{PW}@127.0.0.1:{srv.port}/0"})
    (warning,) = _secret_warnings(caplog)
    assert "secondary tier 'redis': key 'url' holds a secret" in warning
    assert "KVSTORE_REDIS_PASSWORD (password_env)" in warning
    assert "non-default args" in warning
    assert PW not in caplog.text

    caplog.clear()
    monkeypatch.setenv("KVSTORE_REDIS_PASSWORD", PW)
    _run(harness_factory, {"type": "redis", "url": f"redis://127.0.0.1:{srv.port}/0"})
    assert _secret_warnings(caplog) == []


def test_s3_keys_in_the_config_are_warned_once(
        tier_config: Callable[..., dict[str, Any]], harness_factory: Callable[..., Any],
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    _run(harness_factory, tier_config())  # aws_access_key_id / aws_secret_access_key inline
    (warning,) = _secret_warnings(caplog)
    assert "keys 'aws_access_key_id', 'aws_secret_access_key' hold a secret" in warning
    assert "AWS credential chain" in warning
    assert FAKE_SECRET not in caplog.text and FAKE_KEY_ID not in caplog.text

    caplog.clear()
    chain = {k: v for k, v in tier_config().items() if not k.startswith("aws_")}
    _run(harness_factory, chain)  # the same keys, from the environment
    assert _secret_warnings(caplog) == []


def test_a_tls_key_is_a_path_not_its_contents() -> None:
    pem = "-----BEGIN PRIVATE KEY-----\nMIIEv" + "A" * 40 + "\n-----END PRIVATE KEY-----\n"
    from kvstore_tiers.config import validate_config

    with pytest.raises(ConfigError) as info:
        validate_config(RedisConfig, "redis", {"url": "rediss://h:6380/0",
                                               "tls_cert_file": "/etc/kv/client.crt",
                                               "tls_key_file": pem})
    assert "key 'tls_key_file': Value error, must be the path of a file" in str(info.value)
    assert "MIIEv" not in str(info.value)
    ok = validate_config(RedisConfig, "redis", {"url": "rediss://h:6380/0",
                                                "tls_cert_file": "/etc/kv/client.crt",
                                                "tls_key_file": "/etc/kv/client.key"})
    assert ok.tls_key_file == "/etc/kv/client.key"
