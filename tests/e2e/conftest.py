"""Session fixtures for the end-to-end tests (the expensive runs, shared).

The tiny model, a no-connector baseline, and one warmed tier directory that
tests copy before using, so each test stays independent of the others.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from e2e_helpers import FOREIGN_SALT, WarmTier, run

from kvstore_tiers.tools.demo.models import tiny_llama_model_dir


@pytest.fixture(scope="session")
def e2e_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="session")
def tiny_model(e2e_dir: Path) -> Path:
    return tiny_llama_model_dir(e2e_dir / "tiny-llama", seed=0)


@pytest.fixture(scope="session")
def tiny_baseline(tiny_model: Path, e2e_dir: Path) -> dict[str, Any]:
    """The same prompts on an engine WITHOUT any KV connector."""
    return run("baseline", tiny_model, None, e2e_dir / "runs")


@pytest.fixture(scope="session")
def warm_tier(tiny_model: Path, e2e_dir: Path) -> WarmTier:
    """Phase 1 once: two fs tiers, ours by name, the second in another namespace."""
    root, foreign = e2e_dir / "tier", e2e_dir / "tier-foreign"
    tiers = [
        {"type": "fs", "root_dir": str(root)},
        {"type": "fs", "root_dir": str(foreign), "namespace_salt": FOREIGN_SALT},
    ]
    cold = run("warm-tier", tiny_model, tiers, e2e_dir / "runs")
    return WarmTier(root, foreign, cold)
