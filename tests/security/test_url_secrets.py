"""A Redis password in any URL form redis-py accepts never shows: not in a
redacted URL, a config's repr or dump, the tier's start-up line, a connect
error, the logs, or the output of any CLI command that takes a URL.

The server is a real redis-server with ``requirepass`` (TCP and a unix socket).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kvstore_tiers.backends.redis import RedisConfig
from kvstore_tiers.cli import main as cli_main
from kvstore_tiers.errors import ConfigError
from kvstore_tiers.redact import redact_nodes, redact_text, redact_url

PW = "url-Pa55-never-9d41"
PW_QUOTED = "url-Pa55%2Fnever-9d41"  # percent-encoded '/' in a password

# (URL template, what must survive redaction). {pw} is the password, {port}/{sock} the server.
URL_FORMS = [
    ("redis://:{pw}@127.0.0.1:{port}/0", "127.0.0.1:{port}/0"),
    ("redis://default:{pw}@127.0.0.1:{port}/0", "default:***@127.0.0.1"),
    ("redis://127.0.0.1:{port}/0?password={pw}", "password=***"),
    ("redis://127.0.0.1:{port}/0?username=default&password={pw}", "username=default"),
    ("redis://127.0.0.1:{port}/0?password={pw}&socket_timeout=5", "socket_timeout=5"),
    ("unix://{sock}?db=0&password={pw}", "unix://{sock}"),
]
SHAPE_ONLY = [  # forms checked without a server (TLS, cluster nodes, odd passwords)
    f"unix://:{PW}@/var/run/redis.sock?db=0",
    f"rediss://default:{PW}@cache.example:6380/0?ssl_cert_reqs=required",
    f"rediss://cache.example:6380/0?password={PW}",
    f"redis://h:1/0?ssl_password={PW}",
    f"redis://u:{PW}@@h:1/0",  # '@' inside the password
    f"redis://h:1/0?password={PW_QUOTED}",
    f"redis://h:1/0?password={PW}#tail",
]


def _leaks(text: str) -> bool:
    return PW in text or PW_QUOTED in text or "never-9d41" in text


@pytest.mark.parametrize("url", [u.format(pw=PW, port=6379, sock="/tmp/r.sock")
                                 for u, _ in URL_FORMS] + SHAPE_ONLY)
def test_redact_url_hides_every_form(url: str) -> None:
    out = redact_url(url)
    assert not _leaks(out), out
    assert "***" in out
    assert out.split("://")[0] == url.split("://")[0]  # the scheme stays
    assert not _leaks(redact_text(f"cannot connect to {url}: refused"))


def test_redact_keeps_urls_without_secrets() -> None:
    for url in ("redis://127.0.0.1:6379/0", "unix:///var/run/redis.sock?db=2",
                "http://minio:9000", "10.0.0.5:7000"):
        assert redact_url(url) == url
    assert redact_nodes(["a:1", f"u:{PW}@b:2"]) == ["a:1", "u:***@b:2"]


@pytest.mark.parametrize("url", [u.format(pw=PW, port=6379, sock="/tmp/r.sock")
                                 for u, _ in URL_FORMS] + SHAPE_ONLY)
def test_config_dump_is_as_safe_as_its_repr(url: str) -> None:
    cfg = RedisConfig(url=url)
    for text in (repr(cfg), str(cfg), str(cfg.model_dump()), cfg.model_dump_json(),
                 json.dumps(cfg.model_dump(mode="json"))):
        assert not _leaks(text), text
    assert cfg.url == url  # the connecting code still has the real URL
    nodes = RedisConfig(nodes=["10.0.0.1:7000", f"admin:{PW}@10.0.0.2:7000"])
    assert not _leaks(nodes.model_dump_json())


@pytest.fixture
def auth_server(redis_server_factory: Any, tmp_path: Path) -> Any:
    sock = tmp_path / "redis.sock"
    srv = redis_server_factory(["--requirepass", PW, "--unixsocket", str(sock),
                                "--unixsocketperm", "700"])
    srv.sock = str(sock)
    return srv


def _urls(srv: Any) -> list[tuple[str, str]]:
    return [(u.format(pw=PW, port=srv.port, sock=srv.sock),
             keep.format(port=srv.port, sock=srv.sock)) for u, keep in URL_FORMS]


def test_tier_start_line_and_logs_hide_every_form(auth_server: Any, harness_factory: Any,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    for url, keep in _urls(auth_server):
        h = harness_factory([{"type": "redis", "url": url}], num_chunks=4, chunk_bytes=4096)
        tier = h.tiers[0]
        assert tier.backend.client.ping()  # authenticated with the password from the URL
        texts = [repr(tier), str(tier), tier.backend.describe(), repr(tier.config),
                 tier.config.model_dump_json()]
        for text in texts:
            assert not _leaks(text), text
        assert keep in tier.backend.describe()
    assert "kvstore tier" in caplog.text  # the start-up line was captured
    assert not _leaks(caplog.text)


def test_connect_errors_hide_every_form(auth_server: Any, harness_factory: Any,
                                        caplog: pytest.LogCaptureFixture) -> None:
    """A dead port and a wrong password: the error names the server, never the password."""
    caplog.set_level(logging.DEBUG)
    dead = auth_server.port + 1 if auth_server.port < 65535 else auth_server.port - 1
    for url in (f"redis://127.0.0.1:{dead}/0?password={PW}",
                f"redis://:{PW}@127.0.0.1:{dead}/0",
                f"redis://127.0.0.1:{auth_server.port}/0?password={PW}x"):
        with pytest.raises(ConfigError) as info:
            harness_factory([{"type": "redis", "url": url, "retries": 0,
                              "connect_timeout_s": 1}], num_chunks=4, chunk_bytes=4096)
        assert not _leaks(str(info.value)), str(info.value)
        assert "127.0.0.1" in str(info.value)
    assert not _leaks(caplog.text)


CLI_COMMANDS = [
    ["stats"], ["stats", "--json"], ["check"], ["verify"],
    ["gc", "--max-age", "7d", "--dry-run"], ["gc", "--max-age", "7d", "--json"],
]


@pytest.mark.parametrize("args", CLI_COMMANDS, ids=lambda a: " ".join(a))
def test_cli_commands_hide_every_form(auth_server: Any, args: list[str],
                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    dead = f"redis://127.0.0.1:{auth_server.port + 1}/0?password={PW}"
    runner = CliRunner()
    for url, _ in [*_urls(auth_server), (dead, "")]:
        res = runner.invoke(cli_main, [*args, "--redis", url])
        out = res.output + (repr(res.exception) if res.exception else "")
        assert not _leaks(out), f"{args} {url}: {out}"
        if url != dead:
            assert res.exit_code == 0, out
            assert "127.0.0.1" in out or auth_server.sock in out or args[-1] == "--json"
        else:
            assert res.exit_code != 0
    assert not _leaks(caplog.text)


def _config_tier(*args: str) -> tuple[dict[str, Any], Any]:
    """(the first printed tier, the result) of ``kvstore-tiers config ... --json-only``."""
    res = CliRunner().invoke(cli_main, ["config", *args, "--json-only"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)["kv_connector_extra_config"]["secondary_tiers"][0], res


def test_config_moves_the_password_to_password_env(auth_server: Any, harness_factory: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`config` prints no password in any form: the tier reads it from password_env,
    stderr says how to set that variable, and the printed tier then connects."""
    monkeypatch.setenv("KVSTORE_REDIS_PASSWORD", PW)
    given = [["--tier", "redis", "--url", url] for url, _ in _urls(auth_server)]
    given.append(["--tiers-json", json.dumps({"type": "redis", "password": PW,
                                              "url": f"redis://127.0.0.1:{auth_server.port}/0"})])
    for args in given:
        tier, res = _config_tier(*args)
        assert not _leaks(res.stdout) and not _leaks(res.stderr), res.output
        assert tier["password_env"] == "KVSTORE_REDIS_PASSWORD" and "password" not in tier
        assert "read -rs KVSTORE_REDIS_PASSWORD && export KVSTORE_REDIS_PASSWORD" in res.stderr
        h = harness_factory([tier], num_chunks=4, chunk_bytes=4096)
        assert h.tiers[0].backend.client.ping()  # authenticated with the variable's password
    full = CliRunner().invoke(cli_main, ["config", *given[0]])  # config, setup, command
    assert full.exit_code == 0 and not _leaks(full.output)
    assert "export KVSTORE_REDIS_PASSWORD" in full.stdout


def test_config_names_a_variable_per_password() -> None:
    tiers = [{"type": "redis", "url": f"redis://:{PW}@10.0.0.1:6379/0"},
             {"type": "redis", "url": "redis://10.0.0.2:6379/0", "password": PW},
             {"type": "redis", "url": "redis://:other@10.0.0.3:6379/0"},
             {"type": "redis", "url": "redis://10.0.0.4:6379/0"}]
    res = CliRunner().invoke(cli_main, ["config", "--tiers-json", json.dumps(tiers),
                                        "--json-only"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)["kv_connector_extra_config"]["secondary_tiers"]
    assert [t.get("password_env") for t in out] == [
        "KVSTORE_REDIS_PASSWORD", "KVSTORE_REDIS_PASSWORD", "KVSTORE_REDIS_PASSWORD_2", None]
    assert "other" not in res.output and not _leaks(res.output)


def test_config_inline_secrets_keeps_the_url_and_warns() -> None:
    """--inline-secrets prints the URL as given; stderr names the key, never the password."""
    url = f"redis://127.0.0.1:6379/0?password={PW}"
    tier, res = _config_tier("--tier", "redis", "--url", url, "--inline-secrets")
    assert tier["url"] == url and "password_env" not in tier
    assert "key 'url' holds a secret" in res.stderr and "password_env" in res.stderr
    assert not _leaks(res.stderr)
    plain, res = _config_tier("--tier", "redis", "--url", "redis://127.0.0.1:6379/0")
    assert "password_env" not in plain and res.stderr == ""
