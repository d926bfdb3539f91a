"""``kvstore-tiers bench --engine``: time to first token in real vLLM engines, per tier.

The demo's two-phase workload (:mod:`kvstore_tiers.tools.demo`) against three
arms: our fs tier (``"fs"``), vLLM's stock fs tier (``"vllm_fs"``, kept by our
plugin when it takes over ``"fs"``) and no tier at all (recompute). A tier run
is two engine processes on a fresh directory: phase 1 (cold) stores the
prompts' KV, phase 2 (warm) is a new process, empty caches, that answers the
same prompts from the tier. The recompute run is one engine process without a
KV connector answering the same prompts.

A pair is one run of each arm; the order is reversed every pair (ours, stock,
recompute; then recompute, stock, ours; ...), so a drift of the machine's
speed during a pair moves both tiers alike. :mod:`.engine_summary` turns the
runs into the paired ratios.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore_tiers.tools.bench.engine_summary import ARMS, summarize
from kvstore_tiers.tools.demo.prompts import PromptPlan
from kvstore_tiers.tools.demo.runner import PhaseError, PhaseSpec, run_phase

#: Tier type of each arm (None: no KV connector) and the module its class must come from.
TIER_TYPES: dict[str, str | None] = {"ours": "fs", "stock": "vllm_fs", "recompute": None}
TIER_MODULES = {"ours": "kvstore_tiers.", "stock": "vllm."}
#: The plugins a phase loads: ours (tier types, "vllm_fs") and, on vLLM's CPU
#: build, the platform plugin that lets the OffloadingConnector run there.
PHASE_ENV = {"VLLM_PLUGINS": "kvstore_tiers,kvstore_cpu_platform",
             "KVSTORE_TIERS_KEEP_VLLM_FS": "0"}


@dataclass
class EnginePlan:
    """What one ``bench --engine`` run measures."""

    pairs: int = 6
    model: str = "smollm2"
    plan: PromptPlan = field(default_factory=PromptPlan)
    max_tokens: int = 8
    block_size: int = 128
    dtype: str = "float32"
    #: Engine core and worker inside each phase process (each phase is still a
    #: new process): ~20 s less start-up per engine on 2 cores.
    single_process: bool = True
    #: Tier directories (one fresh directory per run, removed after it).
    directory: Path = field(default_factory=lambda: Path(".bench-kvstore"))
    #: Phase logs and results (``<log_dir>/pair<N>-<arm>/<phase>/``), and
    #: ``runs.jsonl``: each run's record as soon as it ends.
    log_dir: Path = field(default_factory=lambda: Path("bench-results") / "engine-runs")
    phase_timeout_s: float = 1200.0

    def describe(self) -> dict[str, Any]:
        out = {k: (str(v) if isinstance(v, Path) else v) for k, v in self.__dict__.items()}
        out["plan"] = self.plan.to_json()
        return out


def run_order(pair: int) -> list[str]:
    """The arms of ``pair`` in the order they run: reversed every other pair."""
    return list(ARMS) if pair % 2 == 0 else list(reversed(ARMS))


def _phase_record(result: dict[str, Any]) -> dict[str, Any]:
    """What the summary and the JSON keep of a phase result."""
    prompts = result["prompts"]
    return {
        "ttft_s": [p["ttft_s"] for p in prompts],
        # the TTFT's two parts by vLLM's timestamps (None where it has none)
        "queued_s": [p.get("queued_s") for p in prompts],
        "prefill_s": [p.get("prefill_s") for p in prompts],
        "outputs": [p["output_token_ids"] for p in prompts],
        "external_hit_tokens": [p["external_hit_tokens"] for p in prompts],
        "local_hit_tokens": [p["local_hit_tokens"] for p in prompts],
        "tier_read_bytes": sum(p["tier_read_bytes"] for p in prompts),
        "tier_write_bytes": sum(p["tier_write_bytes"] for p in prompts),
        "prompt_tokens": [p["prompt_tokens"] for p in prompts],
        "engine_load_s": result.get("engine_load_s"),
        "log_path": result.get("log_path"),
    }


def run_arm(plan: EnginePlan, model_dir: str, pair: int, position: int, arm: str,
            on_phase: Callable[[str], None]) -> dict[str, Any]:
    """One run of ``arm`` (on a fresh tier directory); a failed engine is recorded, not raised."""
    name = f"pair{pair + 1:02d}-{arm}"
    tier_type = TIER_TYPES[arm]
    root = (plan.directory / name).resolve()
    shutil.rmtree(root, ignore_errors=True)
    tiers = None
    if tier_type is not None:
        root.mkdir(parents=True)
        tiers = [{"type": tier_type, "root_dir": str(root)}]
    record: dict[str, Any] = {"pair": pair, "position": position, "arm": arm,
                              "tier_type": tier_type, "error": None}
    phases = ("cold", "warm") if tiers is not None else ("warm",)
    t0 = time.monotonic()
    try:
        for phase in phases:
            on_phase(f"pair {pair + 1}/{plan.pairs}: {arm} {phase}")
            spec = PhaseSpec(name=phase, model=model_dir, plan=plan.plan, secondary_tiers=tiers,
                             max_tokens=plan.max_tokens, block_size=plan.block_size,
                             dtype=plan.dtype, single_process=plan.single_process,
                             env=dict(PHASE_ENV))
            result = run_phase(spec, plan.log_dir / name, timeout_s=plan.phase_timeout_s)
            record[phase] = _phase_record(result)
            if tier_type is not None:
                cls = result.get("tier_classes", {}).get(tier_type, "")
                record["tier_class"] = cls
                record["tier_ok"] = cls.startswith(TIER_MODULES[arm])
    except PhaseError as exc:
        record["error"] = str(exc).splitlines()[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    record["seconds"] = time.monotonic() - t0
    return record


def run(plan: EnginePlan, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Every pair's runs, then the summary: ``{"plan", "model_dir", "runs", "summary"}``."""
    from kvstore_tiers.tools.demo.models import resolve_model

    progress(f"engine: preparing model {plan.model}")
    model_dir = str(resolve_model(plan.model))
    plan.directory.mkdir(parents=True, exist_ok=True)
    plan.log_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    with open(plan.log_dir / "runs.jsonl", "w") as log:
        for pair in range(plan.pairs):
            for position, arm in enumerate(run_order(pair)):
                runs.append(run_arm(plan, model_dir, pair, position, arm, progress))
                # an interrupted run still leaves the pairs it finished
                log.write(json.dumps(runs[-1]) + "\n")
                log.flush()
    return {"plan": plan.describe(), "model_dir": model_dir, "runs": runs,
            "summary": summarize(runs)}


def phase_count(plan: EnginePlan) -> int:
    """Engine processes the plan starts (the progress bar's length)."""
    per_pair = sum(2 if t else 1 for t in TIER_TYPES.values())
    return plan.pairs * per_pair + 1
