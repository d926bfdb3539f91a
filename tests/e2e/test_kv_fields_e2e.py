"""A tier written by one engine, read by an engine whose KV bytes differ: clean miss.

The tests reuse the session's warm tier (float32, 128-token chunks) and change one
setting that shapes KV: the chunk size (blocks per chunk), the model dtype (with
``kv_cache_dtype`` auto, the KV cache dtype follows it) and the KV cache dtype
(``fp8``; vLLM's CPU attention runs it only on x86 with AVX-512 or AMX, so that
test skips elsewhere, naming vLLM's refusal)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from e2e_helpers import TINY_PLAN, WarmTier, copy_tier, outputs, run, tier_counters

from kvstore_tiers.tools.demo.runner import PhaseSpec, run_phase

pytestmark = pytest.mark.engine


def _assert_clean_miss(result: dict[str, Any], root: Path, namespaces: int) -> None:
    assert [p["external_hit_tokens"] for p in result["prompts"]] == [0] * len(result["prompts"])
    counters = tier_counters(result)
    assert counters["objects_loaded"] == 0 and counters.get("corrupt_objects", 0) == 0
    assert counters["objects_stored"] > 0  # it wrote its own namespace beside the old one
    assert len(list(root.glob("*/config.json"))) == namespaces


def test_chunk_size_changed_misses(warm_tier: WarmTier, tiny_baseline: dict[str, Any],
                                   tiny_model: Path, e2e_dir: Path) -> None:
    root = copy_tier(warm_tier.root, e2e_dir / "tier-chunk256")
    spec = PhaseSpec(name="chunk256", model=str(tiny_model), plan=TINY_PLAN,
                     secondary_tiers=[{"type": "fs", "root_dir": str(root)}], max_tokens=8,
                     block_size=256, single_process=True, dtype="float32", warmup_tokens=0)
    result = run_phase(spec, e2e_dir / "runs", timeout_s=600)
    assert outputs(result) == outputs(tiny_baseline)
    _assert_clean_miss(result, root, namespaces=2)


def test_model_dtype_changed_misses(warm_tier: WarmTier, tiny_model: Path,
                                    e2e_dir: Path) -> None:
    root = copy_tier(warm_tier.root, e2e_dir / "tier-bf16")
    baseline = run("bf16-baseline", tiny_model, None, e2e_dir / "runs", dtype="bfloat16")
    result = run("bf16-on-fp32-tier", tiny_model, [{"type": "fs", "root_dir": str(root)}],
                 e2e_dir / "runs", dtype="bfloat16")
    assert outputs(result) == outputs(baseline)
    _assert_clean_miss(result, root, namespaces=2)


# vLLM's CPU attention (cpu_attn._get_attn_isa) refuses an fp8 KV cache with
# NotImplementedError("FP8 KV cache on CPU requires x86 with AVX-512 or AMX.")
needs_fp8_kv = pytest.mark.skipif(
    not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()),
    reason="vLLM's CPU build: 'FP8 KV cache on CPU requires x86 with AVX-512 or AMX.'")


@needs_fp8_kv
def test_kv_cache_dtype_changed_misses_and_fp8_is_served(
        warm_tier: WarmTier, tiny_model: Path, e2e_dir: Path) -> None:
    """An fp8 KV cache engine on the float32 tier: a clean miss with its own
    baseline's output; a second fp8 engine is then served the fp8 objects."""
    root = copy_tier(warm_tier.root, e2e_dir / "tier-fp8")
    baseline = run("fp8-baseline", tiny_model, None, e2e_dir / "runs", kv_cache_dtype="fp8")
    assert len({tuple(out) for out in outputs(baseline)}) > 1, outputs(baseline)
    cold = run("fp8-on-fp32-tier", tiny_model, [{"type": "fs", "root_dir": str(root)}],
               e2e_dir / "runs", kv_cache_dtype="fp8")
    assert outputs(cold) == outputs(baseline)
    _assert_clean_miss(cold, root, namespaces=2)
    warm = run("fp8-served", tiny_model, [{"type": "fs", "root_dir": str(root)}],
               e2e_dir / "runs", kv_cache_dtype="fp8")
    assert warm["prompts"][0]["external_hit_tokens"] > 0
    counters = tier_counters(warm)
    assert counters["objects_loaded"] > 0 and counters.get("corrupt_objects", 0) == 0
    assert outputs(warm) == outputs(baseline)
