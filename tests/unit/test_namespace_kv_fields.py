"""Every engine setting that changes KV bytes changes the namespace: a store made
under one is a clean MISS under another.

Each case builds the engine's real VllmConfig (``EngineArgs.create_engine_config``),
the real KVCacheConfig (``get_kv_cache_configs``) and the real OffloadingConfig
(``build_offloading_config``), then vLLM's TieringOffloadingSpec and manager with
our fs tier, as an engine does minus the model runner."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore_tiers.admin.harness import Harness, make_keys
from tests.unit.engine_configs import BASE, kv_cache_config_for, vllm_config_for

pytest.importorskip("vllm.engine.arg_utils")


def _no_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_unspecified()


# The 0.33 tree here is vLLM's Python code without a platform build: it makes
# engine configs only with VLLM_TARGET_DEVICE=cpu set before vLLM resolves its
# platform, which scripts/test.sh does in a pass of its own for this module.
pytestmark = pytest.mark.skipif(_no_platform(), reason="needs a vLLM platform build (CPU)")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from kvstore_tiers.tools.demo.models import tiny_llama_model_dir

    d = tmp_path_factory.mktemp("models")
    tiny = tiny_llama_model_dir(d / "tiny", seed=0)
    other = d / "tiny-copy"  # the same files under another path (another model name)
    shutil.copytree(tiny, other)
    # two KV heads: TP=2 splits them (vLLM calls that layout parallelism-agnostic);
    # only the config matters here, no weights are loaded
    kv2 = d / "tiny-kv2"
    shutil.copytree(tiny, kv2)
    cfg = json.loads((kv2 / "config.json").read_text())
    (kv2 / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": 2}))
    return {"tiny": tiny, "copy": other, "kv2": kv2}


@pytest.fixture(autouse=True)
def _env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("KVSTORE_TIERS_CACHE", str(tmp_path / "cache"))


@dataclass
class Engine:
    """One engine's configs, and a manager over our fs tier at ``root``."""

    vllm_config: Any
    harness: Harness
    namespace: Any
    _stack: list[Any] = field(default_factory=list)


@pytest.fixture
def engine(models: dict[str, Path], tmp_path: Path) -> Iterator[Any]:
    started: list[Harness] = []

    def start(**changes: Any) -> Engine:
        from vllm.config import set_current_vllm_config
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
            build_offloading_config,
        )
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory

        from kvstore_tiers.plugin import register

        register()
        case = {**BASE, **changes}
        vc = vllm_config_for(models[case["model"]], tmp_path / "tier", case)
        spec = OffloadingSpecFactory.create_spec(
            build_offloading_config(vc, kv_cache_config_for(vc, case["sliding"])))
        with set_current_vllm_config(vc):
            manager = spec.get_manager()
        h = Harness(spec=spec, manager=manager)
        started.append(h)
        return Engine(vc, h, h.tiers[0].namespace)

    yield start
    for h in started:
        h.shutdown()


KEYS = make_keys(4, seed=7)


def _store(engine: Engine) -> None:
    rows = np.random.default_rng(0).integers(0, 256, (len(KEYS), engine.harness.view.shape[1]),
                                             dtype=np.uint8)
    engine.harness.store_all(KEYS, rows)


def _lookup(engine: Engine) -> list[Any]:
    ctx = engine.harness.new_request()
    results, _ = engine.harness.lookup_until_resolved(KEYS, ctx)
    engine.harness.finish_request(ctx)
    return results


def _changed_fields(a: dict[str, Any], b: dict[str, Any]) -> set[str]:
    return {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}


# (case id, engine-setting changes, the run-config fields that must differ)
CASES = [
    ("model", {"model": "copy"}, {"model_name"}),
    ("kv_cache_dtype", {"kv_cache_dtype": "fp8"}, {"dtype"}),
    ("model_dtype", {"dtype": "bfloat16"}, {"dtype", "engine"}),
    ("model_dtype_under_fp8", {"kv_cache_dtype": "fp8", "dtype": "bfloat16"},
     {"dtype", "engine"}),
    ("kv_cache_layout", {"layout": "BLHNC"}, {"kv_cache_layout"}),
    # canonical pages are topology-free: the only layout whose parallel fields collapse
    ("canonical_layout", {"canonical": True}, {"canonical_format", "parallel_agnostic"}),
    ("block_size", {"block_size": 64, "chunk": 128},
     {"kv_cache_groups", "blocks_per_file", "tokens_per_hash"}),
    ("blocks_per_chunk", {"chunk": 256}, {"blocks_per_file"}),
    ("kv_groups", {"sliding": True}, {"kv_cache_groups"}),
]


@pytest.mark.parametrize(("changes", "fields"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_each_field_changes_the_namespace(engine: Any, changes: dict[str, Any],
                                          fields: set[str]) -> None:
    from vllm.v1.kv_offload.base import LookupResult

    base = engine()
    changed = engine(**changes)
    assert _changed_fields(base.namespace.run_config, changed.namespace.run_config) == fields
    assert changed.namespace.digest != base.namespace.digest
    _store(base)
    assert _lookup(changed) == [LookupResult.MISS] * 4
    # control: the same settings again (a new manager, no memory of the store) hit
    assert _lookup(engine()) == [LookupResult.HIT] * 4


def test_model_dtype_only_visible_through_the_engine_fields(engine: Any) -> None:
    """With an fp8 KV cache, vLLM's own run config is the same for a float32 and
    a bfloat16 model; only our ``engine.model_dtype`` tells them apart."""
    a = engine(kv_cache_dtype="fp8")
    b = engine(kv_cache_dtype="fp8", dtype="bfloat16")
    assert a.namespace.run_config["dtype"] == b.namespace.run_config["dtype"]
    assert a.namespace.run_config["engine"]["model_dtype"] == "float32"
    assert b.namespace.run_config["engine"]["model_dtype"] == "bfloat16"


def test_quantization_method_enters_the_engine_fields(engine: Any) -> None:
    """On-the-fly quantisation changes no file; the method is in the namespace.
    (The CPU build cannot build such an engine config, so the field is read
    from the real config with the method set.)"""
    from kvstore_tiers.namespace import engine_fields

    vc = engine().vllm_config
    assert "quantization" not in engine_fields(vc)
    object.__setattr__(vc.model_config, "quantization", "fp8")
    assert engine_fields(vc)["quantization"] == "fp8"


@pytest.mark.parametrize("model", ["tiny", "kv2"])
def test_tensor_parallel_layouts(engine: Any, model: str) -> None:
    """TP=2 then TP=1 on one tier: a MISS, whether vLLM calls the TP=2 layout
    parallelism-agnostic (two KV heads, one per rank) or not (one KV head,
    replicated). The direct layout's chunk is rank-major, so its bytes differ
    between TP sizes; the engine-level proof is tests/e2e/test_tensor_parallel.py."""
    from vllm.v1.kv_offload.base import LookupResult

    tp1 = engine(model=model)
    tp2 = engine(model=model, tp=2)
    assert tp2.vllm_config.parallel_config.tensor_parallel_size == 2
    assert tp2.harness.spec.config.parallel.is_parallelism_agnostic is (model == "kv2")
    cfg1, cfg2 = tp1.namespace.run_config, tp2.namespace.run_config
    assert cfg2["tp_size"] == 2 and cfg2["parallel_agnostic"] is False
    assert cfg1["tp_size"] == 1
    _store(tp2)
    assert _lookup(tp1) == [LookupResult.MISS] * 4
    assert _lookup(engine(model=model, tp=2)) == [LookupResult.HIT] * 4
