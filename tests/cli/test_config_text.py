"""--config text: JSON of any length is read as JSON, and no error repeats it (secrets inside)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .conftest import invoke

SECRET = "pw-DoNotEcho-7d1f"
#: (command, option naming the config) of every command that takes config text.
CONFIG_COMMANDS = (("check", "--config"), ("stats", "--config"), ("verify", "--config"),
                   ("gc", "--config"), ("config", "--tiers-json"))


def _long_fs_config(root: Path) -> str:
    """A valid fs tier of well over 255 characters (a path that long is refused by the OS)."""
    # The long value comes before any '/': read as a path, its first component
    # is too long for the OS (a '/' before it would make it a missing directory).
    text = json.dumps({"type": "fs", "namespace_salt": "x" * 300, "root_dir": str(root),
                       "compression": "none"})
    assert len(text.split("/", 1)[0]) > 255
    return text


def test_long_inline_json_is_read_as_json(fs_store: Path) -> None:
    text = _long_fs_config(fs_store)
    out = invoke("stats", "--config", text, "--json")
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)[0]["objects"] == 8
    for args in (("verify", "--config", text), ("gc", "--config", text, "--max-age", "30d"),
                 ("config", "--tiers-json", text, "--json-only")):
        res = invoke(*args)
        assert res.exit_code == 0, (args[0], res.output)
        assert "File name too long" not in res.output


@pytest.mark.parametrize(("command", "option"), CONFIG_COMMANDS)
def test_no_error_repeats_the_config(command: str, option: str) -> None:
    extra = ("--max-age", "1d") if command == "gc" else ()
    broken = ('{"type": "redis", "url": "redis://127.0.0.1:1/0", "password": "' + SECRET
              + '", "pipeline_batch": 8,, "ttl_s": 60}')
    res = invoke(command, option, broken, *extra)
    assert res.exit_code != 0
    assert "not valid JSON" in res.output and "line 1" in res.output
    assert SECRET not in res.output and "redis://" not in res.output
    bad_key = json.dumps({"type": "redis", "url": "redis://127.0.0.1:1/0", "password": SECRET,
                          "pipline_batch": 8})
    res = invoke(command, option, bad_key, *extra)
    assert res.exit_code != 0 and "pipline_batch" in res.output
    assert SECRET not in res.output
    not_json = f"password={SECRET}"
    res = invoke(command, option, not_json, *extra)
    assert res.exit_code != 0 and "not JSON" in res.output
    assert SECRET not in res.output


def test_a_config_file_is_still_a_file(tmp_path: Path, fs_store: Path) -> None:
    path = tmp_path / "tiers.json"
    path.write_text(_long_fs_config(fs_store))
    out = invoke("stats", "--config", str(path), "--json")
    assert out.exit_code == 0, out.output
    missing = invoke("stats", "--config", str(tmp_path / "nope.json"))
    assert missing.exit_code == 2 and "nope.json" in missing.output
