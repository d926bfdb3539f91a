"""Weights replaced in place: a new engine on the same path never gets the old model's KV."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from e2e_helpers import outputs, run, tier_counters

from kvstore_tiers.tools.demo.models import tiny_llama_model_dir

pytestmark = pytest.mark.engine


def _ready_line(result: dict) -> str:
    log = Path(result["log_path"]).read_text(errors="replace")
    lines = [ln for ln in log.splitlines() if "kvstore tier 'fs' ready" in ln]
    assert lines, "no start-up line from our tier"
    return lines[0]


def test_weights_replaced_at_the_same_path_miss(e2e_dir: Path) -> None:
    model = tiny_llama_model_dir(e2e_dir / "identity-model", seed=0)
    config_before = (model / "config.json").read_text()
    root = e2e_dir / "tier-identity"
    tiers = [{"type": "fs", "root_dir": str(root)}]
    old = run("identity-old", model, tiers, e2e_dir / "runs")
    assert tier_counters(old)["objects_stored"] > 0
    line = _ready_line(old)
    # the engine's own config was found (model dtype), and the weights fingerprinted
    assert "model_dtype float32" in line and "weights sampled:" in line, line

    tiny_llama_model_dir(model, seed=1)  # same config, new random weights, same path
    assert (model / "config.json").read_text() == config_before
    baseline = run("identity-new-baseline", model, None, e2e_dir / "runs")
    new = run("identity-new", model, tiers, e2e_dir / "runs")

    assert outputs(new) == outputs(baseline)
    assert outputs(baseline) != outputs(old)  # the new weights do change the output
    assert [p["external_hit_tokens"] for p in new["prompts"]] == [0] * len(new["prompts"])
    counters = tier_counters(new)
    assert counters["objects_loaded"] == 0 and counters.get("corrupt_objects", 0) == 0
    # one namespace per model version, each with the identity in its config.json
    configs = [json.loads(p.read_text()) for p in root.glob("*/config.json")]
    weights = {c["model_identity"]["weights"] for c in configs}
    assert len(configs) == 2 and len(weights) == 2, configs
    assert re.search(r"weights sampled:[0-9a-f]+", _ready_line(new))
