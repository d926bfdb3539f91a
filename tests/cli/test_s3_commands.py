"""The s3 shortcut's options, lifecycle rules, an unusable S3 store in one line (moto, RGW)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ..servers import FAKE_SECRET, free_port, s3_server_fixture
from .conftest import invoke, populate

s3_endpoint = s3_server_fixture()


def _shortcut(tier: dict[str, Any], *extra: str) -> list[str]:
    return ["--s3", tier["bucket"], "--endpoint-url", tier["endpoint_url"], *extra]


def test_stats_of_a_bucket_without_its_prefix_names_namespaces_in_full(
    tier_config: Callable[..., dict[str, Any]], harness_factory: Callable[..., Any]
) -> None:
    tier = tier_config(prefix="prod/")
    populate(harness_factory, tier)
    out = invoke("stats", *_shortcut(tier), "--json")
    assert out.exit_code == 0, out.output
    ((name, ns),) = json.loads(out.stdout)[0]["namespaces"].items()
    assert name.startswith("prod/org_model_")
    assert ns["objects"] == 8 and ns["model"] == "org/model" and ns["dtype"] == "bfloat16"
    # the same namespace, seen from its prefix, and gc of it by that full name
    inner = json.loads(invoke("stats", *_shortcut(tier, "--prefix", "prod/"), "--json").stdout)
    assert list(inner[0]["namespaces"]) == [name.removeprefix("prod/")]
    gc = invoke("gc", *_shortcut(tier), "--namespace", name, "--max-bytes", "0", "--json")
    assert gc.exit_code == 0, gc.output
    assert json.loads(gc.stdout)[0]["deleted_objects"] == 8


def test_region_profile_and_addressing_style_reach_the_tier(
    tier_config: Callable[..., dict[str, Any]], harness_factory: Callable[..., Any],
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    tier = tier_config()
    populate(harness_factory, tier)
    out = invoke("stats", *_shortcut(tier, "--prefix", "test/", "--region", "us-east-1",
                                     "--addressing-style", "path"), "--json")
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)[0]["objects"] == 8
    creds = tmp_path / "credentials"
    creds.write_text("[ops]\naws_access_key_id = AKIATESTFAKEKEYID001\n"
                     f"aws_secret_access_key = {FAKE_SECRET}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    out = invoke("stats", *_shortcut(tier, "--prefix", "test/", "--profile", "ops"), "--json")
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)[0]["objects"] == 8
    missing = invoke("stats", *_shortcut(tier, "--profile", "nobody"))
    assert missing.exit_code == 1 and "profile" in missing.output and "nobody" in missing.output
    bad = invoke("stats", "--s3", tier["bucket"], "--addressing-style", "sideways")
    assert bad.exit_code == 2
    stray = invoke("stats", "--fs", str(tmp_path), "--region", "eu-west-1")
    assert stray.exit_code == 2 and "--region" in stray.output


def test_lifecycle_installs_and_shows_the_expiry_rule(
    tier_config: Callable[..., dict[str, Any]], s3: Any, bucket: str
) -> None:
    tier = tier_config()
    none = invoke("lifecycle", *_shortcut(tier, "--prefix", "test/"), "--json")
    assert none.exit_code == 0, none.output
    assert json.loads(none.stdout)[0]["rules"] == []
    out = invoke("lifecycle", *_shortcut(tier, "--prefix", "test/", "--days", "7"), "--json")
    assert out.exit_code == 0, out.output
    (rule,) = json.loads(out.stdout)[0]["rules"]
    assert rule["prefix"] == "test/" and rule["expire_days"] == 7 and rule["kvstore_tiers"]
    (stored,) = s3.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"]
    assert stored["Expiration"]["Days"] == 7
    again = invoke("lifecycle", "--config", json.dumps(tier), "--days", "3")
    assert again.exit_code == 0 and "3 d" in again.output and "7 d" not in again.output
    fs = invoke("lifecycle", "--fs", "/tmp")
    assert fs.exit_code == 2 and "S3" in fs.output


def test_gc_on_a_dead_endpoint_is_one_line(tier_config: Callable[..., dict[str, Any]]) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"
    tier = tier_config(endpoint_url=endpoint, max_attempts=1)
    out = invoke("gc", "--config", json.dumps(tier), "--max-age", "1d")
    assert out.exit_code == 1
    assert endpoint in out.output and "Traceback" not in out.output
    assert len(out.output.strip().splitlines()) == 1
    assert FAKE_SECRET not in out.output


def test_gc_without_credentials_is_one_line(
    tier_config: Callable[..., dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    tier = tier_config()
    out = invoke("gc", *_shortcut(tier), "--max-age", "1d")
    assert out.exit_code == 1
    assert "credentials" in out.output and "Traceback" not in out.output
    assert len(out.output.strip().splitlines()) == 1
    # The remedy is the credential chain, not keys in the config (which `config` warns off).
    assert "AWS_ACCESS_KEY_ID" in out.output and "profile" in out.output
    assert "aws_access_key_id" not in out.output


@pytest.mark.parametrize("days", [(), ("--days", "7")], ids=["show", "install"])
def test_lifecycle_of_a_missing_bucket_names_it(tier_config: Callable[..., dict[str, Any]],
                                               days: tuple[str, ...]) -> None:
    tier = tier_config()
    out = invoke("lifecycle", "--s3", "no-such-bucket", "--endpoint-url", tier["endpoint_url"],
                 *days)
    assert out.exit_code == 1
    assert out.output.strip().splitlines() == [
        f"Error: s3 no-such-bucket: bucket 'no-such-bucket' does not exist at "
        f"{tier['endpoint_url']}"]
