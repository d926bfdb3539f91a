"""An engine's real configs without its model runner: the VllmConfig
(``EngineArgs.create_engine_config``) and the KVCacheConfig the scheduler gets
from the workers' layer specs, on vLLM 0.32 and 0.33.

The 0.33 tree here has no platform build; with ``VLLM_TARGET_DEVICE=cpu``
(set before vLLM resolves its platform, so in a process of its own) it
builds configs with the CPU platform's Python code.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

BASE: dict[str, Any] = {"dtype": "float32", "kv_cache_dtype": "auto", "block_size": 128,
                        "chunk": 128, "layout": "LBHNC", "canonical": False, "tp": 1,
                        "sliding": False, "quantization": None, "model": "tiny"}


def vllm_config_for(model: Path, root: Path, case: dict[str, Any]) -> Any:
    """The VllmConfig of an engine with the OffloadingConnector and our fs tier at ``root``."""
    from vllm.engine.arg_utils import EngineArgs

    extra: dict[str, Any] = {
        "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8 << 20,
        "block_size": case["chunk"], "tier_poll_interval_s": 0,
        "secondary_tiers": [{"type": "fs", "root_dir": str(root)}],
    }
    if case["canonical"]:
        extra["canonical_layout"] = True
    args = EngineArgs(
        model=str(model), dtype=case["dtype"], kv_cache_dtype=case["kv_cache_dtype"],
        block_size=case["block_size"], max_model_len=4096, enforce_eager=True,
        tensor_parallel_size=case["tp"], quantization=case["quantization"],
        distributed_executor_backend="mp" if case["tp"] > 1 else None,
        kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                            "engine_id": f"kvstore-test-{uuid.uuid4().hex[:8]}",
                            "kv_connector_extra_config": extra},
    )
    vc = args.create_engine_config()
    vc.cache_config.kv_cache_layout = case["layout"]  # the engine core resolves it
    return vc


def kv_cache_config_for(vc: Any, sliding: bool) -> Any:
    """The engine's KVCacheConfig for the tiny Llama's layers (as the workers report them)."""
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    mc, pc = vc.model_config, vc.parallel_config
    dtype = kv_cache_dtype_str_to_dtype(vc.cache_config.cache_dtype, mc)
    common = {"block_size": vc.cache_config.block_size,
              "num_kv_heads": mc.get_num_kv_heads(pc), "head_size": mc.get_head_size(),
              "dtype": dtype}
    specs: dict[str, Any] = {}
    for i in range(mc.get_num_layers(pc)):
        name = f"model.layers.{i}.self_attn.attn"
        if sliding and i % 2 == 0:
            specs[name] = SlidingWindowSpec(sliding_window=256, **common)
        else:
            specs[name] = FullAttentionSpec(**common)
    try:  # 0.33: the engine core groups the layers first
        from vllm.v1.core.kv_cache_planning import (
            get_global_kv_cache_groups,
            get_kv_cache_configs,
        )
    except ImportError:  # 0.32
        from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

        return get_kv_cache_configs(vc, [specs], [64 << 20])[0]
    groups = get_global_kv_cache_groups(vc, [specs])
    return get_kv_cache_configs(vc, [specs], [64 << 20], groups)[0]


