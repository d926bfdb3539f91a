"""The engine's VllmConfig reaches the namespace of a tier that vLLM's own
connector builds, on the vLLM under test (0.32 and 0.33), and a config that
cannot be read makes the namespace private (every foreign lookup a miss).

vLLM gives a tier no supported handle on the VllmConfig (namespace.current_engine_config
says why); the read depends on how vLLM's connector is constructed, so it is
checked through vLLM's real factory, not a stand-in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvstore_tiers.namespace import EngineConfigUnreadable, Namespace, current_engine_config

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both cases of tests/unit/connector_child.py, built in one child process."""
    pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.factory")
    from kvstore_tiers.tools.demo.models import tiny_llama_model_dir

    work = tmp_path_factory.mktemp("connector")
    model = tiny_llama_model_dir(work / "tiny", seed=0)
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1",
           "KVSTORE_TIERS_CACHE": str(work / "cache"),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "tests.unit.connector_child", str(model),
                           str(work)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("CONNECTOR-RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("CONNECTOR-RESULT "))


def test_vllms_connector_builds_the_tier_with_the_engines_fields(built: dict[str, Any]) -> None:
    import vllm

    for case in built.values():
        assert case["vllm"] == vllm.__version__
        assert case["tier"].startswith("kvstore_tiers."), case["tier"]
        # the supported source is not set here: the fallback is what is tested
        assert case["current_config_set"] is False
    default = built["default"]["run_config"]
    assert default["engine"]["model_dtype"] == "float32"
    assert "unreadable" not in default["engine"]
    fp8 = built["fp8_kv_bfloat16_model"]["run_config"]
    assert fp8["dtype"].startswith("fp8")
    # only the engine's config knows the model dtype once the KV dtype is set
    assert fp8["engine"]["model_dtype"] == "bfloat16"
    assert built["fp8_kv_bfloat16_model"]["model_dtype"] == "bfloat16"


def _spec() -> Any:
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    from kvstore_tiers.admin.harness import make_offloading_config

    return OffloadingSpecFactory.create_spec(make_offloading_config([], model="org/model"))


def _as_vllm_engine(fn: Any) -> Any:
    """Call ``fn`` from a frame of a vLLM engine module (the scheduler's)
    that holds no VllmConfig: what a vLLM that built connectors some other
    way would look like. A fault no real vLLM here produces on demand."""
    scope: dict[str, Any] = {"__name__": "vllm.v1.core.sched.scheduler", "fn": fn}
    exec("def scheduler_init():\n    return fn()\n", scope)
    return scope["scheduler_init"]()


def test_an_unreadable_engine_config_makes_the_namespace_private() -> None:
    with pytest.raises(EngineConfigUnreadable):
        _as_vllm_engine(current_engine_config)
    a = _as_vllm_engine(lambda: Namespace.from_offloading_spec(_spec()))
    b = _as_vllm_engine(lambda: Namespace.from_offloading_spec(_spec()))
    assert "unreadable" in a.run_config["engine"]
    assert a.digest != b.digest and a.name != b.name  # no two processes share it
    # outside an engine (a manager built by hand) the namespace is the same every time
    assert current_engine_config() is None
    assert Namespace.from_offloading_spec(_spec()).digest == \
        Namespace.from_offloading_spec(_spec()).digest


def test_an_engine_frame_far_down_the_stack_still_fails_closed() -> None:
    def deep(n: int) -> Any:
        return current_engine_config() if n == 0 else deep(n - 1)

    with pytest.raises(EngineConfigUnreadable):
        _as_vllm_engine(lambda: deep(100))  # the engine's frame past the config search
