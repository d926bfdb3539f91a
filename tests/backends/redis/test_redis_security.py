"""Passwords (ACL/requirepass) and TLS for the redis tier.

A password must work from the config, the environment or the URL, and must
never show up in ``repr(tier)``, ``describe()``, a ConfigError or the logs.
TLS: a CA, server and client certificates made by the test, redis-server
listening with ``--tls-port``, the tier on ``rediss://``.
"""

from __future__ import annotations

import json
import logging
import subprocess
from typing import Any

import numpy as np
import pytest
from vllm.v1.kv_offload.base import LookupResult

from kvstore_tiers.admin.harness import make_keys
from kvstore_tiers.errors import ConfigError

from ...conftest import rows_like as random_rows
from ...pki import make_pki
from ...servers import REDIS_SERVER

SECRET = "s3cr3t-Pa55-7f2c"


def round_trip(h: Any, n: int = 4, row: int = 4096, seed: int = 1) -> None:
    keys, rows = make_keys(n, seed=seed), random_rows(n, row, seed=seed)
    h.store_all(keys, rows)
    h.forget_primary()
    ctx = h.new_request()
    results, _ = h.lookup_until_resolved(keys, ctx)
    assert results == [LookupResult.HIT] * n
    assert np.array_equal(h.load(keys, ctx), rows)
    h.finish_request(ctx)


@pytest.fixture
def auth_server(redis_server_factory):
    return redis_server_factory(["--requirepass", SECRET, "--maxmemory", "64mb",
                                 "--maxmemory-policy", "allkeys-lru"])


def test_password_from_config_never_shown(auth_server, harness_factory, caplog):
    with caplog.at_level(logging.DEBUG):
        h = harness_factory([{"type": "redis", "url": auth_server.url, "password": SECRET,
                              "n_read_threads": 2, "n_write_threads": 2}],
                            num_chunks=8, chunk_bytes=4096)
        round_trip(h)
    tier = h.tiers[0]
    assert tier.counters.objects_loaded == 4
    for text in (repr(tier), tier.backend.describe(), repr(tier.backend), repr(tier.config),
                 str(tier.config.model_dump()), caplog.text):
        assert SECRET not in text
    assert "auth=yes" in tier.backend.describe()


def test_password_from_environment(auth_server, harness_factory, monkeypatch):
    monkeypatch.setenv("KVSTORE_REDIS_PASSWORD", SECRET)
    h = harness_factory([{"type": "redis", "url": auth_server.url}], num_chunks=8,
                        chunk_bytes=4096)
    round_trip(h)
    monkeypatch.delenv("KVSTORE_REDIS_PASSWORD")
    monkeypatch.setenv("MY_REDIS_PW", SECRET)
    h = harness_factory([{"type": "redis", "url": auth_server.url, "password_env": "MY_REDIS_PW"}],
                        num_chunks=8, chunk_bytes=4096)
    round_trip(h, seed=2)


def test_password_in_url_is_redacted(auth_server, harness_factory, caplog):
    url = f"redis://:{SECRET}@127.0.0.1:{auth_server.port}/0"
    with caplog.at_level(logging.DEBUG):
        h = harness_factory([{"type": "redis", "url": url}], num_chunks=8, chunk_bytes=4096)
        round_trip(h)
    tier = h.tiers[0]
    for text in (repr(tier), repr(tier.config), tier.backend.describe(), caplog.text):
        assert SECRET not in text
    assert ":***@" in h.tiers[0].backend.describe()


def test_wrong_or_missing_password_fails_startup_without_leaking(auth_server, harness_factory,
                                                                 caplog, monkeypatch):
    monkeypatch.delenv("KVSTORE_REDIS_PASSWORD", raising=False)
    wrong = SECRET + "-wrong"
    with caplog.at_level(logging.DEBUG), pytest.raises(ConfigError) as info:
        harness_factory([{"type": "redis", "url": auth_server.url, "password": wrong}])
    assert "authentication failed" in str(info.value)
    assert wrong not in str(info.value) and wrong not in caplog.text
    with pytest.raises(ConfigError, match=r"requires a password|authentication"):
        harness_factory([{"type": "redis", "url": auth_server.url}])


def test_acl_user(redis_server_factory, harness_factory):
    srv = redis_server_factory([])
    with srv.client() as c:
        c.acl_setuser("kv", enabled=True, passwords=[f"+{SECRET}"], keys=["kvstore:*"],
                      commands=["+@all"])
    h = harness_factory([{"type": "redis", "url": srv.url, "username": "kv",
                          "password": SECRET}], num_chunks=8, chunk_bytes=4096)
    round_trip(h)
    assert "user=kv" in h.tiers[0].backend.describe()


# ----------------------------------------------------------------------------- TLS
def _redis_has_tls() -> bool:
    # A TLS-less build rejects the option itself; a TLS build complains about the cert.
    out = subprocess.run([REDIS_SERVER, "--port", "0", "--tls-port", "1"], capture_output=True,
                         text=True, timeout=10)
    return "tls-cert-file" in out.stdout + out.stderr


@pytest.fixture
def tls_server(redis_server_factory, tmp_path):
    pytest.importorskip("cryptography")
    if not _redis_has_tls():
        pytest.skip("this redis-server was built without TLS support")
    pki = make_pki(tmp_path)
    srv = redis_server_factory(
        ["--tls-cert-file", pki["server_cert"], "--tls-key-file", pki["server_key"],
         "--tls-ca-cert-file", pki["ca"], "--tls-auth-clients", "yes"],
        tls={"ssl_ca_certs": pki["ca"], "ssl_certfile": pki["client_cert"],
             "ssl_keyfile": pki["client_key"]},
    )
    return srv, pki


def test_tls_with_client_certificate(tls_server, harness_factory):
    srv, pki = tls_server
    h = harness_factory([{"type": "redis", "url": f"rediss://127.0.0.1:{srv.port}/0",
                          "tls_ca_file": pki["ca"], "tls_cert_file": pki["client_cert"],
                          "tls_key_file": pki["client_key"]}], num_chunks=8, chunk_bytes=4096)
    round_trip(h)
    with srv.client() as c:
        assert c.dbsize() == 4


def test_tls_misconfigurations_fail_startup_clearly(tls_server, harness_factory, tmp_path):
    srv, pki = tls_server
    url = f"rediss://127.0.0.1:{srv.port}/0"
    # No client certificate, but the server demands one.
    with pytest.raises(ConfigError, match="cannot connect"):
        harness_factory([{"type": "redis", "url": url, "tls_ca_file": pki["ca"], "retries": 0}])
    # A CA that did not sign the server certificate.
    other = tmp_path / "other"
    other.mkdir()
    wrong_ca = make_pki(other)["ca"]
    with pytest.raises(ConfigError, match="TLS"):
        harness_factory([{"type": "redis", "url": url, "tls_ca_file": wrong_ca,
                          "tls_cert_file": pki["client_cert"],
                          "tls_key_file": pki["client_key"], "retries": 0}])
    # Plain redis:// against a TLS port.
    with pytest.raises(ConfigError, match="cannot connect"):
        harness_factory([{"type": "redis", "url": f"redis://127.0.0.1:{srv.port}/0",
                          "retries": 0, "connect_timeout_s": 1, "socket_timeout_s": 1}])
    # TLS files with a plain URL is a config mistake, caught before connecting.
    with pytest.raises(ConfigError, match="rediss"):
        harness_factory([{"type": "redis", "url": f"redis://127.0.0.1:{srv.port}/0",
                          "tls_ca_file": pki["ca"]}])


def test_an_unset_password_env_fails_startup_naming_key_and_variable(harness_factory,
                                                                      monkeypatch):
    monkeypatch.delenv("KVSTORE_TEST_REDIS_PW", raising=False)
    tier = {"type": "redis", "url": "redis://127.0.0.1:1/0",
            "password_env": "KVSTORE_TEST_REDIS_PW"}
    with pytest.raises(ConfigError, match=r"key 'password_env': KVSTORE_TEST_REDIS_PW is not "
                                          r"set in the environment"):
        harness_factory([tier])
    monkeypatch.setenv("KVSTORE_TEST_REDIS_PW", "")
    with pytest.raises(ConfigError, match=r"key 'password_env': KVSTORE_TEST_REDIS_PW is empty"):
        harness_factory([tier])


@pytest.mark.parametrize("key", ["tls_ca_file", "tls_cert_file", "tls_key_file"])
@pytest.mark.parametrize("where", ["url", "nodes"])
def test_a_missing_tls_file_fails_startup_naming_key_and_path(key, where, harness_factory,
                                                              tmp_path):
    present = tmp_path / "present.pem"
    present.write_text("not read further: the missing file fails first\n")
    missing = tmp_path / "missing.pem"
    tier: dict[str, Any] = {"type": "redis", "retries": 0, "tls_ca_file": str(present),
                            "tls_cert_file": str(present), "tls_key_file": str(present)}
    tier.update({"url": "rediss://127.0.0.1:1/0"} if where == "url"
                else {"nodes": ["127.0.0.1:1"], "tls": True})
    tier[key] = str(missing)
    with pytest.raises(ConfigError) as info:
        harness_factory([tier])
    assert f"key '{key}': cannot read {missing}: No such file" in str(info.value)


def test_config_output_names_the_variable_that_start_up_insists_on(harness_factory,
                                                                   monkeypatch):
    """`config --json-only` keeps stdout to the JSON a script hands vLLM; what to set goes
    to stderr, and cannot be lost: the JSON names the variable, and a tier started
    without it fails naming it."""
    from click.testing import CliRunner

    from kvstore_tiers.cli import main

    monkeypatch.delenv("KVSTORE_REDIS_PASSWORD", raising=False)
    res = CliRunner().invoke(main, ["config", "--tier", "redis", "--url",
                                    f"redis://:{SECRET}@127.0.0.1:1/0", "--json-only"])
    assert res.exit_code == 0, res.output
    (tier,) = json.loads(res.stdout)["kv_connector_extra_config"]["secondary_tiers"]
    assert tier["password_env"] == "KVSTORE_REDIS_PASSWORD"
    assert "read -rs KVSTORE_REDIS_PASSWORD" in res.stderr
    assert SECRET not in res.output
    with pytest.raises(ConfigError, match=r"key 'password_env': KVSTORE_REDIS_PASSWORD is "
                                          r"not set in the environment"):
        harness_factory([tier])
