"""Every command against a real fs store (tmp dir), written by vLLM's real manager."""

from __future__ import annotations

import json
from pathlib import Path

from .conftest import age, flip_byte, invoke, kvf_files

COMMANDS = ("bench", "check", "config", "demo", "gc", "stats", "verify")


def test_help_of_every_command() -> None:
    out = invoke("--help")
    assert out.exit_code == 0
    for cmd in COMMANDS:
        assert cmd in out.output
        sub = invoke(cmd, "--help")
        assert sub.exit_code == 0, sub.output
        assert "Usage:" in sub.output


def test_check_round_trips_a_block(tmp_path: Path) -> None:
    cfg = json.dumps({"type": "fs", "root_dir": str(tmp_path / "kv")})
    out = invoke("check", "--config", cfg, "--json")
    assert out.exit_code == 0, out.output
    (rep,) = json.loads(out.stdout)
    assert rep["ok"] and rep["codec"] == "none" and rep["namespace"].startswith("org_model_")
    assert rep["load_ms"] > 0 and rep["store_ms"] > 0
    assert kvf_files(tmp_path / "kv") == []  # the test block is removed afterwards
    human = invoke("check", "--fs", str(tmp_path / "kv"))
    assert human.exit_code == 0 and "OK" in human.output and "O_DIRECT" in human.output


def test_check_accepts_a_whole_kv_transfer_config_file(tmp_path: Path) -> None:
    cfg = invoke("config", "--tier", "fs", "--root-dir", str(tmp_path / "kv"), "--json-only")
    path = tmp_path / "ktc.json"
    path.write_text(cfg.output)
    out = invoke("check", "--config", str(path), "--json")
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)[0]["ok"]


def test_check_names_a_bad_key_and_a_bad_value(tmp_path: Path) -> None:
    cfg = json.dumps([{"type": "fs", "root_dir": str(tmp_path), "root_dri": "x",
                       "n_read_threads": 0}])
    out = invoke("check", "--config", cfg)
    assert out.exit_code == 1
    assert "root_dri" in out.output and "unknown key" in out.output
    assert "n_read_threads" in out.output


def test_check_reports_an_unusable_root_dir(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    out = invoke("check", "--fs", str(blocker / "kv"))
    assert out.exit_code == 1
    assert "root_dir" in out.output


def test_stats_counts_objects_namespaces_and_ages(fs_store: Path) -> None:
    files = kvf_files(fs_store)
    for f in files[:3]:
        age(f, 3 * 86400)
    out = invoke("stats", "--fs", str(fs_store), "--json")
    assert out.exit_code == 0, out.output
    (st,) = json.loads(out.stdout)
    assert st["objects"] == 8
    assert st["bytes"] == sum(f.stat().st_size for f in files)
    ((name, ns),) = st["namespaces"].items()
    assert name == files[0].relative_to(fs_store).parts[0]
    assert ns["model"] == "org/model" and ns["dtype"] == "bfloat16" and "tp_size=1" in ns["layout"]
    # The harness's model has no files to fingerprint: the namespace carries no identity.
    assert ns["identity"] == "off"
    assert st["age_histogram"]["<7d"]["objects"] == 3
    assert st["age_histogram"]["<1m"]["objects"] == 5
    human = invoke("stats", "--fs", str(fs_store))
    assert human.exit_code == 0 and "org/model" in human.output and "age histogram" in human.output


def test_verify_detects_a_flipped_byte_and_deletes_it(fs_store: Path) -> None:
    clean = invoke("verify", "--fs", str(fs_store), "--json")
    assert clean.exit_code == 0, clean.output
    assert json.loads(clean.stdout)[0]["ok"] == 8
    victim = kvf_files(fs_store)[2]
    flip_byte(victim)
    bad = invoke("verify", "--fs", str(fs_store))
    assert bad.exit_code == 1
    assert "checksum mismatch" in bad.output and victim.name in bad.output
    assert victim.exists()  # without --delete nothing is removed
    fixed = invoke("verify", "--fs", str(fs_store), "--delete", "--json")
    assert fixed.exit_code == 1
    rep = json.loads(fixed.stdout)[0]
    assert rep["deleted"] == 1 and rep["ok"] == 7
    assert not victim.exists()
    assert invoke("verify", "--fs", str(fs_store)).exit_code == 0


def test_verify_detects_a_renamed_object_and_truncation(fs_store: Path) -> None:
    a, b = kvf_files(fs_store)[:2]
    b.write_bytes(a.read_bytes())  # right frame, wrong name: the key does not match
    c = kvf_files(fs_store)[3]
    c.write_bytes(c.read_bytes()[:-10])
    out = invoke("verify", "--fs", str(fs_store), "--json")
    assert out.exit_code == 1
    reasons = {Path(x["name"]).name: x["reason"] for x in json.loads(out.stdout)[0]["corrupt"]}
    assert "another key" in reasons[b.name]
    assert "truncated" in reasons[c.name] or "bytes" in reasons[c.name]


def test_verify_sample(fs_store: Path) -> None:
    out = invoke("verify", "--fs", str(fs_store), "--sample", "3", "--json")
    assert out.exit_code == 0
    assert json.loads(out.stdout)[0]["checked"] == 3


def test_gc_by_age(fs_store: Path) -> None:
    files = kvf_files(fs_store)
    old = files[:3]
    for f in old:
        age(f, 2 * 3600)
    dry = invoke("gc", "--fs", str(fs_store), "--max-age", "1h", "--dry-run", "--json")
    assert json.loads(dry.stdout)[0]["deleted_objects"] == 3
    assert len(kvf_files(fs_store)) == 8
    out = invoke("gc", "--fs", str(fs_store), "--max-age", "1h")
    assert out.exit_code == 0, out.output
    assert "deleted 3" in out.output
    assert sorted(kvf_files(fs_store)) == sorted(files[3:])
    ns_dir = files[0].relative_to(fs_store).parts[0]
    assert (fs_store / ns_dir / "config.json").exists()  # gc never removes the run config


def test_gc_down_to_a_size_removes_the_oldest(fs_store: Path) -> None:
    files = kvf_files(fs_store)
    for i, f in enumerate(files):
        age(f, 1000 * (len(files) - i))  # files[0] is the oldest
    size = files[0].stat().st_size
    out = invoke("gc", "--fs", str(fs_store), "--max-bytes", str(3 * size), "--json")
    assert out.exit_code == 0, out.output
    rep = json.loads(out.stdout)[0]
    assert rep["deleted_objects"] == 5 and rep["remaining_bytes"] == 3 * size
    assert kvf_files(fs_store) == sorted(files[5:])


def test_gc_needs_a_limit(fs_store: Path) -> None:
    out = invoke("gc", "--fs", str(fs_store))
    assert out.exit_code == 2 and "--max-age" in out.output


def test_config_prints_json_and_a_serve_line() -> None:
    out = invoke("config", "--tier", "fs", "--root-dir", "/mnt/kv", "--cpu-gb", "32",
                 "--model", "Qwen/Qwen3-8B", "--json-only")
    assert out.exit_code == 0, out.output
    cfg = json.loads(out.stdout)
    extra = cfg["kv_connector_extra_config"]
    assert cfg["kv_connector"] == "OffloadingConnector"
    assert extra["spec_name"] == "TieringOffloadingSpec"
    assert extra["cpu_bytes_to_use"] == 32 << 30
    assert extra["secondary_tiers"] == [{"type": "fs", "root_dir": "/mnt/kv"}]
    full = invoke("config", "--tier", "fs", "--root-dir", "/mnt/kv", "--tier", "redis",
                  "--url", "redis://10.0.0.5:6379/0", "--ttl-s", "3600", "--tier", "s3",
                  "--bucket", "kv-cache", "--model", "Qwen/Qwen3-8B")
    assert full.exit_code == 0, full.output
    assert "--model Qwen/Qwen3-8B" in full.output  # the serve line (test_serve_command)
    line = full.output.split("--kv-transfer-config '", 1)[1].rsplit("'", 1)[0]
    tiers = json.loads(line)["kv_connector_extra_config"]["secondary_tiers"]
    assert [t["type"] for t in tiers] == ["fs", "redis", "s3"]
    assert tiers[1]["ttl_s"] == 3600 and tiers[2]["module_path"] == "kvstore_tiers.tiers"


def test_config_rejects_a_bad_tier(tmp_path: Path) -> None:
    out = invoke("config", "--tiers-json", json.dumps({"type": "fs", "root_dir": "/x",
                                                       "max_bytes": -1}))
    assert out.exit_code == 1 and "max_bytes" in out.output
    assert invoke("config", "--tier", "fs").exit_code == 2  # --root-dir missing


def test_verify_checks_encrypted_objects_without_the_key(
    tmp_path: Path, harness_factory, monkeypatch
) -> None:
    """An operator without the tenant's key must not see (or delete) good
    encrypted blocks as corrupt; damaged headers are still found."""
    from .conftest import populate

    monkeypatch.setenv("KVT_VERIFY_KEY", "11" * 32)
    root = tmp_path / "enc"
    populate(harness_factory, {"type": "fs", "root_dir": str(root),
                               "encryption_key_env": "KVT_VERIFY_KEY"})
    out = invoke("verify", "--fs", str(root), "--delete", "--json")
    assert out.exit_code == 0, out.output
    rep = json.loads(out.stdout)[0]
    assert rep["ok"] == 8 and rep["deleted"] == 0
    assert list(rep["codecs"]) == ["encrypted+none"]
    victim = kvf_files(root)[0]
    victim.write_bytes(victim.read_bytes()[:-1])
    assert invoke("verify", "--fs", str(root)).exit_code == 1


def test_admin_commands_name_a_missing_root(tmp_path: Path) -> None:
    for cmd in (("stats",), ("verify",), ("gc", "--max-age", "1d")):
        out = invoke(cmd[0], "--fs", str(tmp_path / "typo"), *cmd[1:])
        assert out.exit_code == 1, out.output
        assert "key 'root_dir'" in out.output and "typo" in out.output
    assert not (tmp_path / "typo").exists()


def test_admin_commands_start_with_their_output(fs_store: Path) -> None:
    """Off a terminal, no progress line, and so no empty line before the report."""
    for args in (("stats",), ("verify",), ("gc", "--max-age", "30d")):
        res = invoke(*args, "--fs", str(fs_store))
        assert res.exit_code == 0, res.output
        assert res.stderr == "", args
        assert res.output.strip() and not res.output.startswith("\n"), args


def test_config_ends_an_s3_prefix_with_a_slash() -> None:
    # The tier reads "prod" as "prod/": the printed config says what it uses.
    for given in ("prod", "prod/"):
        res = invoke("config", "--tier", "s3", "--bucket", "kv-cache", "--prefix", given,
                     "--json-only")
        assert res.exit_code == 0, res.output
        (tier,) = json.loads(res.stdout)["kv_connector_extra_config"]["secondary_tiers"]
        assert tier["prefix"] == "prod/"
