"""A hybrid model (sliding-window and full-attention layers, two KV cache groups)
through the real engine: a second process is served both groups from the tier with
identical output, and a fully corrupted tier still gives identical output."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from built_models import tiny_gemma3_model_dir
from e2e_helpers import copy_tier, outputs, run, tier_counters

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def gemma(e2e_dir: Path, tiny_model: Path) -> Path:
    return tiny_gemma3_model_dir(e2e_dir / "tiny-gemma3", tiny_model)


@pytest.fixture(scope="module")
def gemma_baseline(gemma: Path, e2e_dir: Path) -> dict[str, Any]:
    baseline = run("gemma-baseline", gemma, None, e2e_dir / "runs")
    # an output that depends on the prompt: one that ignored the KV would prove nothing
    assert all(len(set(out)) > 2 for out in outputs(baseline)), outputs(baseline)
    assert len({tuple(out) for out in outputs(baseline)}) > 1, outputs(baseline)
    return baseline


@pytest.fixture(scope="module")
def gemma_tier(gemma: Path, e2e_dir: Path) -> tuple[Path, dict[str, Any]]:
    root = e2e_dir / "tier-gemma"
    cold = run("gemma-cold", gemma, [{"type": "fs", "root_dir": str(root)}], e2e_dir / "runs")
    return root, cold


def _groups(root: Path) -> set[str]:
    return {p.stem.rsplit("_g", 1)[1] for p in root.rglob("*.kvf")}


def test_second_process_served_both_groups(gemma: Path, gemma_baseline: dict[str, Any],
                                           gemma_tier: tuple[Path, dict[str, Any]],
                                           e2e_dir: Path) -> None:
    root, cold = gemma_tier
    assert outputs(cold) == outputs(gemma_baseline)
    assert _groups(root) == {"0", "1"}, "expected objects of both KV cache groups"
    served = copy_tier(root, e2e_dir / "tier-gemma-served")
    warm = run("gemma-warm", gemma, [{"type": "fs", "root_dir": str(served)}], e2e_dir / "runs")
    assert outputs(warm) == outputs(gemma_baseline)
    assert warm["prompts"][0]["external_hit_tokens"] > 0
    counters = tier_counters(warm)
    assert counters["objects_loaded"] > 0 and counters.get("corrupt_objects", 0) == 0


def test_corrupted_tier_never_changes_the_output(gemma: Path, gemma_baseline: dict[str, Any],
                                                 gemma_tier: tuple[Path, dict[str, Any]],
                                                 e2e_dir: Path) -> None:
    root = copy_tier(gemma_tier[0], e2e_dir / "tier-gemma-corrupt")
    objects = sorted(root.rglob("*.kvf"))
    assert objects
    for i, path in enumerate(objects):  # every object: a flipped byte or a truncation
        data = bytearray(path.read_bytes())
        if i % 2:
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
        else:
            path.write_bytes(bytes(data[: len(data) // 3]))
    warm = run("gemma-corrupt", gemma, [{"type": "fs", "root_dir": str(root)}], e2e_dir / "runs")
    assert outputs(warm) == outputs(gemma_baseline)
    assert [p["external_hit_tokens"] for p in warm["prompts"]] == [0] * len(warm["prompts"])
    counters = tier_counters(warm)
    assert counters["corrupt_objects"] > 0 and counters["objects_loaded"] == 0
