"""``kvstore-tiers config`` on an install without extras: fs and s3 work, redis names its extra.

Run with the Python of a venv holding only the core dependencies
(tests/cli/core_venv.py), not with imports hidden in this one: what the
command imports by accident fails there as on a user's plain install.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .core_venv import make_core_venv, run_cli


@pytest.fixture(scope="module")
def core_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_core_venv(tmp_path_factory.mktemp("core-venv") / "venv")


@pytest.mark.parametrize(("args", "types"), [
    (("--tier", "fs", "--root-dir", "/mnt/kv"), ["fs"]),
    (("--tier", "s3", "--bucket", "kv-cache", "--prefix", "prod/"), ["s3"]),
    (("--tier", "fs", "--root-dir", "/mnt/kv", "--tier", "s3", "--bucket", "kv-cache"),
     ["fs", "s3"]),
], ids=["fs", "s3", "fs+s3"])
def test_config_without_extras(core_python: Path, args: tuple[str, ...], types: list[str],
                               tmp_path: Path) -> None:
    res = run_cli(core_python, "config", *args, "--json-only", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    tiers = json.loads(res.stdout)["kv_connector_extra_config"]["secondary_tiers"]
    assert [t["type"] for t in tiers] == types
    assert res.stderr == ""


def test_config_of_a_redis_tier_names_the_redis_extra(core_python: Path, tmp_path: Path) -> None:
    res = run_cli(core_python, "config", "--tier", "redis", "--url",
                  "redis://:pw@10.0.0.5:6379/0", "--json-only", cwd=tmp_path)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and res.stdout == ""
    assert len(lines) == 1 and "pip install 'kvstore-tiers[redis]'" in lines[0], res.stderr
    assert ":pw@" not in res.stderr
