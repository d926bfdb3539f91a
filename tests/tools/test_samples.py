"""The real KV samples are never guessed: an option or KVSTORE_KV_SAMPLES, a clear error."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from kvstore_tiers.cli import main
from kvstore_tiers.tools import samples


def test_neither_option_nor_environment_names_both(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(samples.ENV, raising=False)
    with pytest.raises(samples.SamplesNotFound, match=samples.ENV):
        samples.resolve(None)


def test_a_directory_without_the_sidecar_is_refused(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(samples.ENV, str(tmp_path))
    with pytest.raises(samples.SamplesNotFound, match=r"kv-samples\.json"):
        samples.resolve(None)
    result = CliRunner().invoke(main, ["bench", "--quick"])
    assert result.exit_code == 2 and "kv-samples.json" in result.output
    result = CliRunner().invoke(main, ["bench", "--samples", str(tmp_path / "nope")])
    assert result.exit_code == 2 and "--samples" in result.output


def test_environment_then_option(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = np.arange(2 * 8, dtype=np.uint8).reshape(2, 8)
    blocks.tofile(tmp_path / "a.bin")
    (tmp_path / "kv-samples.json").write_text(json.dumps(
        {"files": [{"file": "a.bin", "num_blocks": 2, "block_bytes": 8}]}))
    monkeypatch.setenv(samples.ENV, str(tmp_path))
    assert samples.resolve(None) == tmp_path
    [(entry, got)] = samples.load(samples.resolve(None))
    assert entry["file"] == "a.bin" and np.array_equal(got, blocks)
    other = tmp_path / "other"
    with pytest.raises(samples.SamplesNotFound):
        samples.resolve(other)  # an explicit directory wins, even over a good env


def test_s3_endpoint_without_a_bucket_is_a_usage_error() -> None:
    result = CliRunner().invoke(main, ["bench", "--tier", "s3", "--s3-endpoint", "http://x:9000"])
    assert result.exit_code == 2 and "--s3-bucket" in result.output
