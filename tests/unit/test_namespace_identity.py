"""Model identity: which edits of a model's files each fingerprint mode catches,
its cache, and how it enters the namespace."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from kvstore_tiers import fingerprint as fp
from kvstore_tiers.fingerprint import SAMPLE_BYTES, model_identity, sample_offsets
from kvstore_tiers.namespace import Namespace

CONFIG = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 128}


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(fp.CACHE_ENV, str(tmp_path / "cache"))
    fp._memo.clear()


def make_model(d: Path, seed: int = 0, rows: int = 4096) -> Path:
    """A model dir: config.json + one safetensors file of ~8 MiB (well over the samples)."""
    d.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    save_file({"a.weight": rng.standard_normal((rows, 256)).astype(np.float32),
               "b.weight": rng.standard_normal((rows, 256)).astype(np.float32)},
              str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(CONFIG, indent=2))
    return d


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def data_start(path: Path) -> int:
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


def ident(d: Path, mode: str) -> dict[str, str]:
    fp._memo.clear()
    return model_identity(str(d), mode).fields()  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["sampled", "full"])
def test_same_files_anywhere_same_identity(tmp_path: Path, mode: str) -> None:
    a = make_model(tmp_path / "a")
    b = tmp_path / "elsewhere" / "b"
    shutil.copytree(a, b)
    assert ident(a, mode) == ident(b, mode)
    assert ident(a, mode)["weights"].startswith(f"{mode}:")


@pytest.mark.parametrize("mode", ["sampled", "full"])
def test_new_weights_same_shapes_change_identity(tmp_path: Path, mode: str) -> None:
    """A re-save of other weights (fine-tune, new random init) changes every block."""
    a, b = make_model(tmp_path / "a", seed=0), make_model(tmp_path / "b", seed=1)
    assert ident(a, mode)["weights"] != ident(b, mode)["weights"]
    assert ident(a, mode)["config"] == ident(b, mode)["config"]


def test_one_value_between_samples_caught_by_full_only(tmp_path: Path) -> None:
    d = make_model(tmp_path / "m")
    w = d / "model.safetensors"
    size = w.stat().st_size
    offsets = sample_offsets(size)
    # a byte in the middle of the data, in no sampled block
    gap_start = offsets[len(offsets) // 2] + SAMPLE_BYTES
    assert gap_start < offsets[len(offsets) // 2 + 1]
    before = {m: ident(d, m) for m in ("sampled", "full")}
    flip(w, gap_start + 10)
    assert ident(d, "full") != before["full"]
    assert ident(d, "sampled") == before["sampled"]  # the documented blind spot


def test_value_in_a_sampled_block_caught_by_both(tmp_path: Path) -> None:
    d = make_model(tmp_path / "m")
    w = d / "model.safetensors"
    mid = sample_offsets(w.stat().st_size)[len(sample_offsets(w.stat().st_size)) // 2]
    before = {m: ident(d, m) for m in ("sampled", "full")}
    flip(w, mid + 100)
    assert all(ident(d, m) != before[m] for m in before)


def test_header_change_caught_by_both(tmp_path: Path) -> None:
    """Renaming a tensor (or any dtype/shape/offset change) is in the safetensors header."""
    d = make_model(tmp_path / "m")
    w = d / "model.safetensors"
    before = {m: ident(d, m) for m in ("sampled", "full")}
    raw = bytearray(w.read_bytes())
    i = raw.index(b"b.weight", 0, data_start(w))
    raw[i:i + 1] = b"c"
    w.write_bytes(bytes(raw))
    assert all(ident(d, m) != before[m] for m in before)


def test_config_change_caught_by_both_formatting_is_not(tmp_path: Path) -> None:
    d = make_model(tmp_path / "m")
    before = {m: ident(d, m) for m in ("sampled", "full")}
    # same content, other key order and spacing: the same identity
    (d / "config.json").write_text(json.dumps(dict(reversed(CONFIG.items()))))
    assert all(ident(d, m) == before[m] for m in before)
    (d / "config.json").write_text(json.dumps({**CONFIG, "sliding_window": 512}))
    after = {m: ident(d, m) for m in before}
    for m in before:
        assert after[m]["config"] != before[m]["config"]
        assert after[m]["weights"] == before[m]["weights"]


def test_added_weight_file_changes_identity(tmp_path: Path) -> None:
    d = make_model(tmp_path / "m")
    before = ident(d, "sampled")
    save_file({"extra": np.zeros(4, np.float32)}, str(d / "adapter.safetensors"))
    assert ident(d, "sampled") != before


def test_cache_hit_reads_nothing_and_lives_in_the_cache_dir(tmp_path: Path) -> None:
    d = make_model(tmp_path / "m")
    listing = sorted(os.listdir(d))
    fp._memo.clear()
    cold = model_identity(str(d), "full")
    assert cold.bytes_read == (d / "model.safetensors").stat().st_size
    fp._memo.clear()  # a new process: only the on-disk cache
    warm = model_identity(str(d), "full")
    assert warm.bytes_read == 0 and warm.fields() == cold.fields()
    assert sorted(os.listdir(d)) == listing  # nothing written next to the model
    assert list((tmp_path / "cache" / "fingerprints").glob("*.json"))


def test_cache_entry_not_trusted_after_an_edit_that_restores_mtime(tmp_path: Path) -> None:
    """Same size, mtime set back: ctime still moved, so the file is read again."""
    d = make_model(tmp_path / "m")
    w = d / "model.safetensors"
    st = w.stat()
    before = ident(d, "full")
    flip(w, data_start(w) + 1234)
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert w.stat().st_mtime_ns == st.st_mtime_ns
    fp._memo.clear()
    after = model_identity(str(d), "full")
    assert after.bytes_read > 0 and after.fields() != before


def test_hub_snapshot_revision(tmp_path: Path) -> None:
    commit = "0123456789abcdef0123456789abcdef01234567"
    d = make_model(tmp_path / "hub" / "models--org--tiny" / "snapshots" / commit)
    assert ident(d, "sampled")["revision"] == commit
    assert "revision" not in ident(make_model(tmp_path / "plain"), "sampled")


def test_hub_id_resolved_through_the_local_cache(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    hub = tmp_path / "hub"
    commit = "89abcdef0123456789abcdef0123456789abcdef"
    make_model(hub / "models--org--tiny" / "snapshots" / commit)
    (hub / "models--org--tiny" / "refs").mkdir()
    (hub / "models--org--tiny" / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    identity = model_identity("org/tiny", "sampled", download_dir=str(hub))
    assert identity.revision == commit and identity.files == 1


def test_version_replaces_and_off_adds_nothing(tmp_path: Path) -> None:
    d = make_model(tmp_path / "m")
    assert model_identity(str(d), "full", version="v7").fields() == {"model_version": "v7"}
    assert model_identity(str(d), "off").fields() == {}


def test_missing_files_raise(tmp_path: Path) -> None:
    with pytest.raises(fp.FingerprintError, match="no local files"):
        model_identity(str(tmp_path / "nope"), "sampled")
    (tmp_path / "empty").mkdir()
    with pytest.raises(fp.FingerprintError, match="no weight files"):
        model_identity(str(tmp_path / "empty"), "sampled")


# ------------------------------------------------------------------ in the namespace
def _spec(model: Path | str) -> object:
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    from kvstore_tiers.admin.harness import make_offloading_config

    return OffloadingSpecFactory.create_spec(make_offloading_config([], model=str(model)))


def test_namespace_changes_with_weights_at_the_same_path(tmp_path: Path) -> None:
    d = make_model(tmp_path / "m", seed=0)
    ns = {m: Namespace.from_offloading_spec(_spec(d), model_fingerprint=m)
          for m in ("sampled", "full", "off")}
    shutil.rmtree(d)
    make_model(d, seed=1)
    fp._memo.clear()
    for m in ("sampled", "full"):
        again = Namespace.from_offloading_spec(_spec(d), model_fingerprint=m)
        assert again.name != ns[m].name and again.digest != ns[m].digest
        assert again.run_config["model_identity"]["weights"].startswith(m)
    off = Namespace.from_offloading_spec(_spec(d), model_fingerprint="off")
    assert off.name == ns["off"].name  # what "off" risks: the old KV would be served
    assert "model_identity" not in off.run_config


def test_model_version_in_namespace(tmp_path: Path) -> None:
    d = make_model(tmp_path / "m")
    a = Namespace.from_offloading_spec(_spec(d), model_version="2024-06-01")
    b = Namespace.from_offloading_spec(_spec(d), model_version="2024-07-01")
    assert a.name != b.name
    assert a.run_config["model_identity"] == {"model_version": "2024-06-01"}
    assert "model_version 2024-06-01" in a.describe()


def test_unresolved_model_outside_an_engine_is_named_only(tmp_path: Path) -> None:
    ns = Namespace.from_offloading_spec(_spec("org/not-here"), model_fingerprint="sampled")
    assert "model_identity" not in ns.run_config
    assert "unresolved" in ns.describe()


def test_tier_config_rejects_an_unknown_mode() -> None:
    from kvstore_tiers.config import TierConfig, validate_config
    from kvstore_tiers.errors import ConfigError

    with pytest.raises(ConfigError, match="model_fingerprint"):
        validate_config(TierConfig, "fs", {"model_fingerprint": "partial"})
    with pytest.raises(ConfigError, match="model_version"):
        validate_config(TierConfig, "fs", {"model_version": ""})
    assert validate_config(TierConfig, "fs", {}).model_fingerprint == "sampled"
