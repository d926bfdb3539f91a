"""``kvstore-tiers check`` round-trips a block in the user's real store and leaves nothing there."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..servers import RedisServer
from .conftest import invoke, populate


def _everything_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_check_leaves_an_fs_root_as_it_found_it(
    tmp_path: Path, harness_factory: Callable[..., Any]
) -> None:
    root = tmp_path / "kv"
    populate(harness_factory, {"type": "fs", "root_dir": str(root)})  # an engine's namespace
    before = _everything_under(root)
    out = invoke("check", "--fs", str(root), "--json")
    assert out.exit_code == 0, out.output
    (rep,) = json.loads(out.stdout)
    assert rep["ok"] and rep["namespace"].startswith("org_model_")
    assert rep["namespace"] not in before  # a namespace of its own, not the engine's
    assert _everything_under(root) == before  # no config.json, no shard directories
    empty = tmp_path / "empty"
    empty.mkdir()
    assert invoke("check", "--fs", str(empty)).exit_code == 0
    assert _everything_under(empty) == []


def test_check_leaves_nothing_in_s3(tier_config: Callable[..., dict[str, Any]], s3: Any,
                                    bucket: str) -> None:
    out = invoke("check", "--config", json.dumps(tier_config()), "--json")
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)[0]["ok"]
    assert s3.list_objects_v2(Bucket=bucket).get("Contents", []) == []


def test_check_leaves_nothing_in_redis(redis_server: RedisServer) -> None:
    out = invoke("check", "--redis", redis_server.url, "--json")
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)[0]["ok"]
    assert redis_server.client().dbsize() == 0


def test_check_leaves_the_callers_environment_and_logging_as_it_found_them(
        tmp_path: Path, monkeypatch: Any) -> None:
    """check quiets vLLM's start-up lines only while it runs: engines started later by the
    same process (they copy os.environ) and its loggers keep their own levels."""
    import logging
    import os

    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    vllm_log, ours = logging.getLogger("vllm"), logging.getLogger("kvstore_tiers")
    before = (vllm_log.level, ours.level, list(ours.handlers))
    out = invoke("check", "--fs", str(tmp_path / "kv"), "--json")
    assert out.exit_code == 0, out.output
    assert "VLLM_LOGGING_LEVEL" not in os.environ
    assert (vllm_log.level, ours.level, list(ours.handlers)) == before
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "not-a-level")
    out = invoke("check", "--fs", str(tmp_path / "kv"))
    assert out.exit_code != 0 and "VLLM_LOGGING_LEVEL" in out.output
    assert os.environ["VLLM_LOGGING_LEVEL"] == "not-a-level"
