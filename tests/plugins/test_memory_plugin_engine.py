"""A real vLLM engine (tiny random Llama, CPU) served from the plugin's memory tier."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .plugin_helpers import CHILD, REPO, child_env, parse_result

pytestmark = pytest.mark.engine
pytest.importorskip("vllm")

ENGINE_CHILD = CHILD.with_name("child_memory_engine.py")


def test_engine_is_served_from_memory_plugin_tier(plugin_site: Path, tmp_path: Path) -> None:
    env = child_env(plugin_site)
    env.update({
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",           # GiB
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",   # scheduler + worker in the child: one process
        "KVSTORE_TIERS_STATS_DIR": str(tmp_path / "stats"),
    })
    os.makedirs(tmp_path / "stats")
    proc = subprocess.run([sys.executable, str(ENGINE_CHILD), str(tmp_path / "work")],
                          env=env, capture_output=True, text=True, timeout=600, cwd=str(REPO))
    r = parse_result(proc, "engine")
    assert r["tier_classes"]["memory"] == "kvstore_tiers.tiers.MemoryTier"
    assert r["reset_ok"]
    (stats,) = r["tier_stats"]
    c = stats["counters"]
    assert stats["tier_type"] == "memory"
    chunks = r["full_chunks"]
    assert c["objects_stored"] == 2 * chunks      # both prompts cascaded to the tier
    # The repeated prompt: every full chunk promoted from the memory tier...
    assert c["objects_loaded"] == chunks and c["load_failures"] == 0
    assert r["external_hit_tokens"] == chunks * 128
    assert r["tier_read_bytes"] > 0
    # ...and the model's output is the same as when it was computed.
    assert r["same_output"]
