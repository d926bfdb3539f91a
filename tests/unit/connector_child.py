"""Build vLLM's OffloadingConnector (scheduler role) the way the engine does,
through ``KVConnectorFactory.create_connector``, outside any current vLLM
config, and print what reached our tier's namespace as JSON.

Run by tests/unit/test_engine_config_read.py in a process of its own:
``python -m tests.unit.connector_child MODEL_DIR WORK_DIR`` with
``VLLM_TARGET_DEVICE=cpu`` (the platform is resolved once per process).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tests.unit.engine_configs import BASE, kv_cache_config_for, vllm_config_for

#: (case name, engine-setting changes): the second's model dtype is visible
#: only in the engine's config (the OffloadingConfig's dtype is the KV dtype).
CASES = {"default": {}, "fp8_kv_bfloat16_model": {"kv_cache_dtype": "fp8",
                                                  "dtype": "bfloat16"}}


def build(model: Path, root: Path, changes: dict[str, Any]) -> dict[str, Any]:
    import vllm
    from vllm.config import get_current_vllm_config_or_none
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    vc = vllm_config_for(model, root, {**BASE, **changes})
    kv_cache_config = kv_cache_config_for(vc, sliding=False)
    current = get_current_vllm_config_or_none()
    connector = KVConnectorFactory.create_connector(
        config=vc, role=KVConnectorRole.SCHEDULER, kv_cache_config=kv_cache_config)
    manager = connector.connector_scheduler.manager
    try:
        tier = manager.secondary_tiers[0]
        return {"vllm": vllm.__version__, "current_config_set": current is not None,
                "tier": f"{type(tier).__module__}.{type(tier).__name__}",
                "model_dtype": str(vc.model_config.dtype).removeprefix("torch."),
                "run_config": tier.namespace.run_config}
    finally:
        manager.shutdown()


def main() -> None:
    from kvstore_tiers.plugin import register

    model, work = Path(sys.argv[1]), Path(sys.argv[2])
    register()
    out = {name: build(model, work / name, changes) for name, changes in CASES.items()}
    print("CONNECTOR-RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
