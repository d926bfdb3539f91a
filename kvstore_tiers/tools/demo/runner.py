"""Run demo phases in fresh processes and put their results together.

:func:`run_phase` starts ``python -m kvstore_tiers.tools.demo.phase`` (a new
process: empty GPU and CPU caches), streams its progress events to a
callback, and returns its JSON result. :func:`run_demo` is the two-phase
demo: phase 1 ("cold") warms the secondary tier, phase 2 ("warm") is a new
engine process that sends the same prompts and should be served from the tier.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore_tiers.tools.demo.prompts import PromptPlan

EventCallback = Callable[[str, dict[str, Any]], None]
#: File that marks a directory as created by the demo (safe to wipe).
DEMO_MARKER = ".kvstore-tiers-demo"
DEFAULT_FS_ROOT = "./kvstore-data/demo"


class PhaseError(RuntimeError):
    """A phase process failed; ``log_tail`` holds the end of its log."""

    def __init__(self, message: str, log_tail: str) -> None:
        super().__init__(f"{message}\n--- end of phase log ---\n{log_tail}")
        self.log_tail = log_tail


@dataclass
class PhaseSpec:
    """Everything one phase process needs (serialized to JSON)."""

    name: str
    model: str
    plan: PromptPlan
    secondary_tiers: list[dict[str, Any]] | None  # None: no KV connector at all
    max_tokens: int = 8
    block_size: int = 128
    cpu_bytes: int = 256 << 20
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # vLLM's --kv-cache-dtype
    max_model_len: int = 4096
    env: dict[str, str] = field(default_factory=dict)  # extra env (e.g. VLLM_PLUGINS)
    # Engine core and worker inside the phase process (no extra processes):
    # ~20 s faster start-up on 2 cores; the phase itself is still a new process.
    single_process: bool = False
    # Tokens of an unmeasured warm-up request sent first (0: none). It stores
    # its own chunks in the tier, so tests that count objects set 0.
    warmup_tokens: int = 300


#: Cores vLLM's CPU engine reserves (off its OpenMP threads) for one worker with a
#: kv_transfer_config: one for the scheduler and one more for the connector
#: (vllm/utils/ompmultiprocessing.py). Without a connector it reserves one, so on a
#: small machine a no-connector phase would run its OpenMP reductions with more
#: threads, in another order, and a bf16 model's greedy output could differ from a
#: connector phase's with no tier involved (docs/troubleshooting.md).
CONNECTOR_RESERVED_CPUS = 2


def phase_env(spec: PhaseSpec, phase_dir: Path) -> dict[str, str]:
    """The environment of ``spec``'s process: this one's, plus what a phase needs.

    Every phase, with a connector or not, reserves the same cores
    (``VLLM_CPU_NUM_OF_RESERVED_CPU``, unless already set): phases compare
    their outputs, and must compute alike to do so.
    """
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; plenty for the demo
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", str(CONNECTOR_RESERVED_CPUS))
    env["KVSTORE_TIERS_STATS_DIR"] = str(phase_dir / "stats")
    if spec.single_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.update(spec.env)
    return env


def phase_request(spec: PhaseSpec, events_path: Path | None = None) -> dict[str, Any]:
    """What :mod:`kvstore_tiers.tools.demo.phase` builds its engine and prompts from."""
    return {
        "model": spec.model,
        "plan": spec.plan.to_json(),
        "secondary_tiers": spec.secondary_tiers,
        "max_tokens": spec.max_tokens,
        "block_size": spec.block_size,
        "cpu_bytes": spec.cpu_bytes,
        "dtype": spec.dtype,
        "kv_cache_dtype": spec.kv_cache_dtype,
        "max_model_len": spec.max_model_len,
        "events_path": str(events_path) if events_path else None,
        "single_process": spec.single_process,
        "warmup_tokens": spec.warmup_tokens,
    }


def _tail(path: Path, n: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def run_phase(
    spec: PhaseSpec,
    work_dir: Path,
    on_event: EventCallback | None = None,
    timeout_s: float = 900.0,
) -> dict[str, Any]:
    """Run ``spec`` in a new process; return its result dict.

    ``work_dir/<name>/`` gets ``request.json``, ``result.json``, ``events.jsonl``,
    ``phase.log`` (all vLLM output) and ``stats/`` (our tiers' counters).
    Raises :class:`PhaseError` if the process fails or times out."""
    d = Path(work_dir) / spec.name
    if d.exists():
        shutil.rmtree(d)
    (d / "stats").mkdir(parents=True)
    request = phase_request(spec, d / "events.jsonl")
    (d / "request.json").write_text(json.dumps(request, indent=2))
    env = phase_env(spec, d)
    result_path = d / "result.json"
    events_path = d / "events.jsonl"
    log_path = d / "phase.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore_tiers.tools.demo.phase", str(d / "request.json"),
             str(result_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=os.getcwd(),
            start_new_session=True,  # our own process group: killable as a whole
        )
        seen = 0
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                rc = proc.poll()
                seen = _pump_events(events_path, seen, spec.name, on_event)
                if rc is not None:
                    break
                if time.monotonic() > deadline:
                    _kill_group(proc)
                    raise PhaseError(f"phase {spec.name} timed out after {timeout_s:.0f}s",
                                     _tail(log_path))
                time.sleep(0.2)
        except BaseException:
            if proc.poll() is None:
                _kill_group(proc)
            raise
    _pump_events(events_path, seen, spec.name, on_event)
    if rc != 0 or not result_path.exists():
        raise PhaseError(f"phase {spec.name} failed (exit code {rc}); log: {log_path}",
                         _tail(log_path))
    result = json.loads(result_path.read_text())
    result["log_path"] = str(log_path)
    return result


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill the phase process and the vLLM processes it started (its group only)."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


def _pump_events(path: Path, seen: int, phase: str, on_event: EventCallback | None) -> int:
    if not path.exists():
        return seen
    lines = path.read_text().splitlines()
    for line in lines[seen:]:
        try:
            event = json.loads(line)
        except ValueError:
            # a line still being written: read it on the next poll
            return seen
        if on_event is not None:
            on_event(phase, event)
        seen += 1
    return seen


# --------------------------------------------------------------------------- demo


@dataclass
class DemoConfig:
    """Options of the two-phase demo (see ``kvstore-tiers demo --help``)."""

    model: str = "smollm2"
    tier: str = "fs"
    tier_config: list[dict[str, Any]] | None = None  # overrides ``tier``
    fs_root: str = DEFAULT_FS_ROOT
    fresh: bool = True
    plan: PromptPlan = field(default_factory=PromptPlan)
    max_tokens: int = 8
    block_size: int = 128
    cpu_bytes: int = 256 << 20
    baseline: bool = False
    work_dir: str | None = None
    single_process: bool = False
    # float32 by default: with bf16, the different prefill split of a cached
    # vs a recomputed prompt can flip greedy near-ties (seen with SmolLM2);
    # this CPU (AVX2) has no native bf16 anyway.
    dtype: str = "float32"


def prepare_fs_root(root: Path, fresh: bool) -> None:
    """Create ``root``; with ``fresh``, empty it first if the demo made it.

    Refuses to wipe a non-empty directory without the demo's marker file,
    so a mistyped ``--fs-root`` cannot delete someone's data."""
    if fresh and root.exists() and any(root.iterdir()):
        if not (root / DEMO_MARKER).exists():
            raise click_error(
                f"{root} is not empty and was not created by the demo; "
                "pass another --fs-root or --no-fresh"
            )
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / DEMO_MARKER).write_text("created by `kvstore-tiers demo`; safe to delete\n")


def click_error(message: str) -> Exception:
    try:
        import click

        return click.ClickException(message)
    except ImportError:  # pragma: no cover - click is a dependency
        return RuntimeError(message)


def demo_tiers(cfg: DemoConfig) -> list[dict[str, Any]]:
    """The ``secondary_tiers`` list the demo runs with."""
    if cfg.tier_config is not None:
        return cfg.tier_config
    if cfg.tier == "fs":
        root = Path(cfg.fs_root).expanduser().resolve()
        prepare_fs_root(root, cfg.fresh)
        return [{"type": "fs", "root_dir": str(root)}]
    # s3/redis with their defaults (a local endpoint). A per-run namespace
    # salt makes phase 1 start from an empty namespace without deleting data.
    tier: dict[str, Any] = {"type": cfg.tier, "module_path": "kvstore_tiers.tiers"}
    if cfg.tier == "redis":
        tier["url"] = os.environ.get("KVSTORE_DEMO_REDIS_URL", "redis://127.0.0.1:6379/0")
    if cfg.fresh:
        tier["namespace_salt"] = f"demo-{uuid.uuid4().hex[:8]}"
    return [tier]


def run_demo(cfg: DemoConfig, on_event: EventCallback | None = None) -> dict[str, Any]:
    """Cold phase, then warm phase in a new process (plus an optional baseline).

    Returns ``{"config": ..., "phases": {"cold": r1, "warm": r2[, "baseline": r0]}}``."""
    from kvstore_tiers.tools.demo.models import resolve_model

    if on_event:
        on_event("prepare", {"stage": "model", "message": f"preparing model {cfg.model}"})
    model_dir = resolve_model(cfg.model)
    tiers = demo_tiers(cfg)
    default_work = Path(cfg.fs_root).expanduser().parent / "demo-runs"
    work = Path(cfg.work_dir) if cfg.work_dir else default_work
    work.mkdir(parents=True, exist_ok=True)
    common = dict(model=str(model_dir), plan=cfg.plan, max_tokens=cfg.max_tokens,
                  block_size=cfg.block_size, cpu_bytes=cfg.cpu_bytes,
                  single_process=cfg.single_process, dtype=cfg.dtype)
    phases: dict[str, Any] = {}
    if cfg.baseline:
        phases["baseline"] = run_phase(PhaseSpec(name="baseline", secondary_tiers=None, **common),
                                       work, on_event)
    phases["cold"] = run_phase(PhaseSpec(name="cold", secondary_tiers=tiers, **common), work,
                               on_event)
    phases["warm"] = run_phase(PhaseSpec(name="warm", secondary_tiers=tiers, **common), work,
                               on_event)
    return {"config": {"model": cfg.model, "model_dir": str(model_dir), "tiers": tiers,
                       "plan": cfg.plan.to_json(), "block_size": cfg.block_size,
                       "max_tokens": cfg.max_tokens, "dtype": cfg.dtype},
            "phases": phases}
