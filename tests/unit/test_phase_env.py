"""Phases that compare outputs compute alike: the same reserved CPU cores with a
connector and without one (docs/troubleshooting.md, "Outputs differ ... on a CPU machine")."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore_tiers.tools.demo.prompts import PromptPlan
from kvstore_tiers.tools.demo.runner import CONNECTOR_RESERVED_CPUS, PhaseSpec, phase_env

PLAN = PromptPlan(prefix_tokens=16, suffix_tokens=16, num_prompts=1)


@pytest.mark.parametrize("single_process", [False, True], ids=["engine-core", "single"])
def test_phases_with_and_without_a_connector_reserve_the_same_cores(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, single_process: bool) -> None:
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    specs = [PhaseSpec(name=name, model="m", plan=PLAN, secondary_tiers=tiers,
                       single_process=single_process)
             for name, tiers in (("baseline", None),
                                 ("cold", [{"type": "fs", "root_dir": str(tmp_path)}]))]
    envs = [phase_env(spec, tmp_path / spec.name) for spec in specs]
    assert {e["VLLM_CPU_NUM_OF_RESERVED_CPU"] for e in envs} == {str(CONNECTOR_RESERVED_CPUS)}
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "3")  # the user's choice stands
    assert {phase_env(s, tmp_path)["VLLM_CPU_NUM_OF_RESERVED_CPU"] for s in specs} == {"3"}
