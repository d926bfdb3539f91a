"""Helpers for the end-to-end tests: real vLLM engines on CPU, each phase in a new process.

Engines run with ``single_process`` (scheduler and worker inside the phase
process; each phase is still its own fresh process) to keep the set within a
few minutes on 2 cores. Session fixtures share the expensive runs: the tiny
model, a no-connector baseline, and one warmed tier directory that tests copy.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore_tiers.tools.demo.prompts import PromptPlan
from kvstore_tiers.tools.demo.runner import PhaseSpec, run_phase

# 3 prompts of 750 tokens: 600 shared (4 full 128-token chunks shared, the
# 5th chunk distinct per prompt).
TINY_PLAN = PromptPlan(prefix_tokens=600, suffix_tokens=150, num_prompts=3)
BLOCK = 128
FOREIGN_SALT = "e2e-foreign-namespace"


def phase_spec(name: str, model: Path, tiers: list[dict[str, Any]] | None,
               plan: PromptPlan = TINY_PLAN, env: dict[str, str] | None = None,
               dtype: str = "float32", kv_cache_dtype: str = "auto") -> PhaseSpec:
    """The e2e tests' engine: tiny, float32, greedy, one process, no warm-up."""
    return PhaseSpec(name=name, model=str(model), plan=plan, secondary_tiers=tiers,
                     max_tokens=8, block_size=BLOCK, single_process=True, env=env or {},
                     dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                     warmup_tokens=0)  # 0: keeps object counts exact


def run(name: str, model: Path, tiers: list[dict[str, Any]] | None, work: Path,
        plan: PromptPlan = TINY_PLAN, env: dict[str, str] | None = None,
        dtype: str = "float32", kv_cache_dtype: str = "auto") -> dict[str, Any]:
    """One phase in a new process (see kvstore_tiers.tools.demo.phase)."""
    spec = phase_spec(name, model, tiers, plan, env, dtype, kv_cache_dtype)
    return run_phase(spec, work, timeout_s=600)


def outputs(result: dict[str, Any]) -> list[list[int]]:
    return [p["output_token_ids"] for p in result["prompts"]]


def tier_counters(result: dict[str, Any], tier_type: str | None = None) -> dict[str, int]:
    """Our tiers' cumulative counters, summed over the phase's tiers (or those of ``tier_type``).

    Read from the stats files our tiers write at shutdown
    (KVSTORE_TIERS_STATS_DIR, set per phase by run_phase). Empty if the tier
    in use is not ours (e.g. vLLM's stock fs tier)."""
    total: dict[str, int] = {}
    for s in result.get("tier_stats") or []:
        if tier_type is not None and s.get("tier_type") != tier_type:
            continue
        for k, v in s.get("counters", {}).items():
            total[k] = total.get(k, 0) + int(v)
    return total


def vllm_per_tier(result: dict[str, Any], counter: str) -> dict[str, int]:
    """vLLM's own ``counter`` per secondary tier, the tiers it never counted left out.

    Keys are vLLM's tier labels: list position from 1 and type (``"2:redis"``)."""
    values = (result.get("tier_metrics") or {}).get(counter, {})
    return {tier: int(v) for tier, v in values.items() if v}


@dataclass
class WarmTier:
    root: Path          # namespace of the test model, written by phase 1
    foreign_root: Path  # same keys, another namespace (namespace_salt)
    cold: dict[str, Any]


def copy_tier(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# The tiny plan's chunk arithmetic (BLOCK tokens per offloaded chunk).
PROMPT_TOKENS = TINY_PLAN.prefix_tokens + TINY_PLAN.suffix_tokens
FULL_CHUNKS = PROMPT_TOKENS // BLOCK            # full chunks per prompt
SHARED_CHUNKS = TINY_PLAN.prefix_tokens // BLOCK  # chunks shared by all prompts
DISTINCT_CHUNKS = SHARED_CHUNKS + TINY_PLAN.num_prompts * (FULL_CHUNKS - SHARED_CHUNKS)


def assert_prompt_hits(warm: dict) -> None:
    """Prompt 1 of a fresh process: every full chunk from the tier; later
    prompts: the shared prefix from the local prefix cache, the rest from the tier."""
    first, *rest = warm["prompts"]
    assert first["prompt_tokens"] == PROMPT_TOKENS
    assert first["local_hit_tokens"] == 0
    assert first["external_hit_tokens"] == FULL_CHUNKS * BLOCK
    assert first["tier_read_bytes"] > 0
    for p in rest:
        assert p["local_hit_tokens"] == SHARED_CHUNKS * BLOCK
        assert p["external_hit_tokens"] == (FULL_CHUNKS - SHARED_CHUNKS) * BLOCK


def assert_served_from_tier(cold: dict, warm: dict, tier_type: str) -> None:
    """The warm phase (a new engine process) was served as :func:`assert_prompt_hits`
    says, by our tier class, loaded every distinct chunk without corruption,
    and generated exactly the cold phase's tokens."""
    assert warm["tier_classes"][tier_type].startswith("kvstore_tiers."), warm["tier_classes"]
    assert_prompt_hits(warm)
    counters = tier_counters(warm)
    assert counters["objects_loaded"] == DISTINCT_CHUNKS
    assert counters["corrupt_objects"] == 0
    assert counters.get("load_failures", 0) == 0
    assert outputs(warm) == outputs(cold)  # identical tokens, served vs computed
