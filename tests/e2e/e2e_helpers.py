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

from kvstore_tiers.demo.prompts import PromptPlan
from kvstore_tiers.demo.runner import PhaseSpec, run_phase

# 3 prompts of 750 tokens: 600 shared (4 full 128-token chunks shared, the
# 5th chunk distinct per prompt).
TINY_PLAN = PromptPlan(prefix_tokens=600, suffix_tokens=150, num_prompts=3)
BLOCK = 128
FOREIGN_SALT = "e2e-foreign-namespace"


def run(name: str, model: Path, tiers: list[dict[str, Any]] | None, work: Path,
        plan: PromptPlan = TINY_PLAN, env: dict[str, str] | None = None,
        dtype: str = "float32") -> dict[str, Any]:
    """One phase in a new process (see kvstore_tiers.demo.phase)."""
    spec = PhaseSpec(name=name, model=str(model), plan=plan, secondary_tiers=tiers,
                     max_tokens=8, block_size=BLOCK, single_process=True, env=env or {},
                     dtype=dtype, warmup_tokens=0)  # 0: keeps object counts exact
    return run_phase(spec, work, timeout_s=600)


def outputs(result: dict[str, Any]) -> list[list[int]]:
    return [p["output_token_ids"] for p in result["prompts"]]


def tier_counters(result: dict[str, Any]) -> dict[str, int]:
    """Our tiers' cumulative counters, summed over the phase's tiers.

    Read from the stats files our tiers write at shutdown
    (KVSTORE_TIERS_STATS_DIR, set per phase by run_phase). Empty if the tier
    in use is not ours (e.g. vLLM's stock fs tier)."""
    total: dict[str, int] = {}
    for s in result.get("tier_stats") or []:
        for k, v in s.get("counters", {}).items():
            total[k] = total.get(k, 0) + int(v)
    return total


@dataclass
class WarmTier:
    root: Path          # namespace of the test model, written by phase 1
    foreign_root: Path  # same keys, another namespace (namespace_salt)
    cold: dict[str, Any]


def copy_tier(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst
