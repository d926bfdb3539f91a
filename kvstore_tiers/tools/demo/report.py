"""Render a demo result (:func:`kvstore_tiers.tools.demo.runner.run_demo`) with rich."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def _mib(n: float | int | None) -> str:
    return "-" if n is None else f"{n / (1 << 20):.1f}"


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1000:.0f}"


def outputs_match(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Same greedy output token ids."""
    return list(a["output_token_ids"]) == list(b["output_token_ids"])


def build_table(result: dict[str, Any]) -> Table:
    """Per-prompt table: tokens, cache sources, TTFT cold vs warm, bytes, match."""
    phases = result["phases"]
    cold, warm = phases["cold"]["prompts"], phases["warm"]["prompts"]
    base = phases.get("baseline", {}).get("prompts")
    cfg = result["config"]
    tiers = ", ".join(t.get("type", "?") for t in cfg["tiers"])
    table = Table(
        title=f"KV offloading to a secondary tier ({tiers}) — model {cfg['model']}, "
        f"{cfg.get('dtype', '')}, chunk {cfg['block_size']} tokens",
        caption="cold: phase 1, empty tier (writes it). warm: phase 2, a NEW engine process "
        "(empty GPU/CPU caches) reading the tier.\nlocal = vLLM's own prefix cache in that "
        "process; from tier = external hits (vllm:external_prefix_cache_hits).",
    )
    table.add_column("#", justify="right")
    table.add_column("prompt\ntokens", justify="right")
    table.add_column("warm\nlocal\nhits", justify="right")
    table.add_column("warm\nfrom\ntier", justify="right", style="bold green")
    table.add_column("TTFT\ncold\nms", justify="right")
    table.add_column("TTFT\nwarm\nms", justify="right", style="bold")
    table.add_column("speed\nup", justify="right")
    table.add_column("cold\nwrote\nMiB", justify="right")
    table.add_column("warm\nread\nMiB", justify="right")
    table.add_column("same\noutput", justify="center")
    for i, (c, w) in enumerate(zip(cold, warm, strict=True)):
        match = outputs_match(c, w) and (base is None or outputs_match(base[i], w))
        speed = (
            f"{c['ttft_s'] / w['ttft_s']:.1f}x" if c.get("ttft_s") and w.get("ttft_s") else "-"
        )
        table.add_row(
            str(i + 1),
            str(w["prompt_tokens"]),
            str(w["local_hit_tokens"]),
            str(w["external_hit_tokens"]),
            _ms(c.get("ttft_s")),
            _ms(w.get("ttft_s")),
            speed,
            _mib(c.get("tier_write_bytes")),
            _mib(w.get("tier_read_bytes")),
            "[green]yes[/]" if match else "[red]NO[/]",
        )
    return table


def summary_lines(result: dict[str, Any]) -> list[str]:
    """A few lines under the table: totals and engine start-up times."""
    phases = result["phases"]
    lines = []
    for name in ("baseline", "cold", "warm"):
        if name not in phases:
            continue
        p = phases[name]
        prompts = p["prompts"]
        counters: dict[str, int] = {}
        for s in p.get("tier_stats") or []:
            for k, v in s.get("counters", {}).items():
                counters[k] = counters.get(k, 0) + int(v)
        line = (
            f"{name:8s} engine start {p['engine_load_s']:.1f} s; "
            f"tier hits {sum(x['external_hit_tokens'] for x in prompts)} tokens; "
            f"written {_mib(sum(x['tier_write_bytes'] for x in prompts))} MiB, "
            f"read {_mib(sum(x['tier_read_bytes'] for x in prompts))} MiB"
        )
        if counters:
            line += (
                f"; tier objects stored {counters.get('objects_stored', 0)}, "
                f"loaded {counters.get('objects_loaded', 0)}, "
                f"corrupt {counters.get('corrupt_objects', 0)}"
            )
        lines.append(line)
    if "warm" in phases:
        w = phases["warm"]["prompts"][0]
        lines.append(f"first warm output: {w['output_text']!r}")
    return lines


def render(result: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    console.print(build_table(result))
    for line in summary_lines(result):
        console.print(line, highlight=False)
