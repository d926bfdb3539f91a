"""``kvstore-tiers bench --engine --tier s3|redis``: a fresh engine's first prompt served
from a remote tier at network distance.

Per round and remote tier, in real vLLM engine processes (:mod:`kvstore_tiers.tools.demo`):

* **fill**: one engine on loopback answers the prompt and stores its KV in the tier,
  under a namespace of its own (a fresh ``namespace_salt`` per round);
* **first prompt at RTT r**, for every RTT: a fresh engine process (new connections,
  empty GPU and CPU caches) whose tier reaches the server through the delaying proxy
  of :mod:`kvstore_tiers.tools.netem.delay` (through :func:`.distance.at_distance`) at
  ``r`` ms, RTT 0 included (the same proxy adding no delay, so every cell pays the
  proxy's own hop alike), answers the same prompt: every full block of it comes from
  the tier;
* **recompute**: a fresh engine without a KV connector answers it (the tier must still
  win at the largest RTT).

The RTT cells and the recompute run are taken in an order reversed every round. The
fresh engines send only a warm-up shorter than one block first (no tier lookup: the
prompt is the first thing their tier serves) and the fill's prompt is all they ask.

What it reports, per RTT: the first prompt's time to first token and its two parts by
vLLM's timestamps (the wait before its first schedule: the tier's lookups and loads;
the forward pass after it), medians over rounds, and **extra RTTs**: ``(TTFT(r) -
TTFT(0)) / r`` paired within each round, the median over rounds (also of the wait).
The target is the round trips the protocol needs (:meth:`.distance._Side.rtts` of a
fresh engine), one per wave of parallel requests: redis, one EXISTS pipeline, then
the GETs (:data:`PROTOCOL_RTTS`); s3, existence checks that GET, whose bodies the load
takes (one wave; two, HEADs then GETs, with ``lookup_prefetch_bytes: 0``); on an s3
server that closes every connection after its answer (moto's does) each wave also pays
a TCP handshake. A run
fails (and leaves its round's figures) when its engine failed, when its first prompt
got less than all its full blocks from the tier, or when its output differs from the
same round's recompute run.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore_tiers.tools.bench import distance
from kvstore_tiers.tools.bench.engine_bench import PHASE_ENV
from kvstore_tiers.tools.demo.prompts import PromptPlan
from kvstore_tiers.tools.demo.runner import PhaseError, PhaseSpec, run_phase

#: Round trips a fresh engine's first load of a prefix (one wave of each) needs on top
#: of loopback on kept-alive connections: the existence checks, then the GETs.
PROTOCOL_RTTS = 2
#: RTTs measured when none are given (0 always added: the baseline).
DEFAULT_RTTS_MS: dict[str, tuple[float, ...]] = {"s3": (0.0, 20.0, 50.0),
                                                 "redis": (0.0, 1.0, 5.0)}
RECOMPUTE = "recompute"


@dataclass
class EngineDistancePlan:
    """What one ``bench --engine --tier s3|redis`` run measures."""

    tiers: tuple[str, ...] = ("s3",)
    #: RTTs in ms (None: :data:`DEFAULT_RTTS_MS` of each tier); 0 is always measured.
    rtts_ms: tuple[float, ...] | None = None
    rounds: int = 3
    model: str = "tiny"
    plan: PromptPlan = field(default_factory=lambda: PromptPlan(num_prompts=1))
    max_tokens: int = 4
    block_size: int = 128
    dtype: str = "float32"
    #: The engine core in its own process, as ``vllm serve`` runs it. Inside the
    #: phase process (vLLM's in-process client) the engine loop steps without the
    #: pause EngineCore's busy loop takes when no model ran, so while the prompt
    #: waits for the tier that loop holds the GIL and every tier I/O thread waits
    #: a switch interval for it at each blocking call's return: there a fresh
    #: engine's first prompt measures the interpreter, not the distance
    #: (docs/benchmarks.md#a-fresh-engine-at-distance).
    single_process: bool = False
    #: The servers (its own moto_server / redis-server, or the user's) and tier keys.
    servers: distance.DistancePlan = field(default_factory=distance.DistancePlan)
    #: Phase logs (``<log_dir>/<tier>-r<N>-<cell>/<phase>/``) and ``runs.jsonl``.
    log_dir: Path = field(default_factory=lambda: Path("bench-results") / "engine-distance")
    phase_timeout_s: float = 900.0

    def rtts_for(self, tier: str) -> tuple[float, ...]:
        """The RTT cells of ``tier``, 0 first."""
        given = self.rtts_ms if self.rtts_ms else DEFAULT_RTTS_MS[tier]
        return (0.0, *sorted({float(r) for r in given} - {0.0}))

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: (str(v) if isinstance(v, Path) else v)
                               for k, v in self.__dict__.items() if k != "servers"}
        out["plan"] = self.plan.to_json()
        out["tier_keys"] = self.servers.tier_keys
        return out


def cell_order(cells: Sequence[float | None], round_: int) -> list[float | None]:
    """The runs of ``round_`` in the order they go: reversed every other round."""
    return list(cells) if round_ % 2 == 0 else list(reversed(cells))


def phase_count(plan: EngineDistancePlan) -> int:
    """Engine processes the plan starts (the progress bar's length)."""
    return sum(plan.rounds * (len(plan.rtts_for(t)) + 2) for t in plan.tiers)


def _first(result: dict[str, Any]) -> dict[str, Any]:
    """What the summary keeps of a phase: its first prompt, and the tier's counters."""
    p = result["prompts"][0]
    counters: dict[str, int] = {}
    for s in result.get("tier_stats") or []:
        for k, v in s.get("counters", {}).items():
            counters[k] = counters.get(k, 0) + int(v)
    return {"ttft_s": p["ttft_s"], "queued_s": p.get("queued_s"),
            "prefill_s": p.get("prefill_s"), "prompt_tokens": p["prompt_tokens"],
            "external_hit_tokens": p["external_hit_tokens"],
            "tier_read_bytes": p["tier_read_bytes"], "output": p["output_token_ids"],
            "engine_load_s": result.get("engine_load_s"), "counters": counters,
            "log_path": result.get("log_path")}


def _spec(plan: EngineDistancePlan, name: str, model_dir: str,
          tiers: list[dict[str, Any]] | None) -> PhaseSpec:
    # The warm-up fills no block: a fresh engine's first tier lookup is the prompt's.
    return PhaseSpec(name=name, model=model_dir, plan=plan.plan, secondary_tiers=tiers,
                     max_tokens=plan.max_tokens, block_size=plan.block_size,
                     dtype=plan.dtype, single_process=plan.single_process,
                     env=dict(PHASE_ENV), warmup_tokens=plan.block_size - 1)


def prompt_blocks(plan: EngineDistancePlan) -> int:
    """Full blocks of the prompt a fresh engine loads (vLLM computes the last token)."""
    return (plan.plan.prefix_tokens + plan.plan.suffix_tokens - 1) // plan.block_size


def run_tier(plan: EngineDistancePlan, name: str, model_dir: str, log: Any,
             progress: Callable[[str], None]) -> dict[str, Any]:
    """Every round of tier ``name``: ``{"server", "closes_connections", "target_rtts",
    "rtts_ms", "runs", "summary"}``."""
    rtts = plan.rtts_for(name)
    runs: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        side = distance.remote(name, plan.servers, stack)
        for r in range(plan.rounds):
            salt = f"engine-distance-{uuid.uuid4().hex[:8]}"

            def tiers(url: str, salt: str = salt) -> list[dict[str, Any]]:
                return [{**side.tier_config(url), "namespace_salt": salt}]

            work = plan.log_dir / f"{name}-r{r + 1}"
            progress(f"{name} round {r + 1}/{plan.rounds}: fill")
            fill: dict[str, Any] = {"tier": name, "round": r, "cell": "fill", "error": None}
            try:
                fill.update(_first(run_phase(_spec(plan, "fill", model_dir, tiers(side.url)),
                                             work, timeout_s=plan.phase_timeout_s)))
            except PhaseError as exc:
                fill["error"] = str(exc).splitlines()[0]
            _log(log, fill)
            for position, rtt in enumerate(cell_order([*rtts, None], r)):
                cell = RECOMPUTE if rtt is None else f"rtt{rtt:g}"
                progress(f"{name} round {r + 1}/{plan.rounds}: {cell}")
                rec: dict[str, Any] = {"tier": name, "round": r, "position": position,
                                       "rtt_ms": rtt, "error": None}
                try:
                    if fill["error"]:
                        raise PhaseError(f"fill failed: {fill['error']}", "")
                    if rtt is None:
                        result = run_phase(_spec(plan, cell, model_dir, None), work,
                                           timeout_s=plan.phase_timeout_s)
                    else:
                        with distance.at_distance(side.url, rtt) as url:
                            result = run_phase(_spec(plan, cell, model_dir, tiers(url)), work,
                                               timeout_s=plan.phase_timeout_s)
                    rec.update(_first(result))
                except PhaseError as exc:
                    rec["error"] = str(exc).splitlines()[0]
                runs.append(rec)
                _log(log, rec)
        server, closes = side.server, bool(getattr(side, "closes", False))
        target = side.rtts(prompt_blocks(plan), fresh=True)
    return {"server": server, "closes_connections": closes, "target_rtts": target,
            "rtts_ms": list(rtts), "runs": runs,
            "summary": summarize(runs, rtts, plan.block_size, target)}


def _log(log: Any, record: dict[str, Any]) -> None:
    # an interrupted run still leaves the runs it finished
    log.write(json.dumps(record) + "\n")
    log.flush()


def run_failures(run: dict[str, Any], reference: list[int] | None, block: int) -> list[str]:
    """Why ``run`` does not count (empty: it passed). ``reference``: the output of its
    round's recompute run (None: that run failed)."""
    if run.get("error"):
        return [f"engine failed: {run['error']}"]
    reasons = []
    if not run.get("ttft_s"):
        reasons.append("no time to first token")
    if run["rtt_ms"] is not None:
        full = (run["prompt_tokens"] - 1) // block * block
        if run["external_hit_tokens"] < full:
            reasons.append(f"{run['external_hit_tokens']} of {full} prompt tokens from the tier")
        if reference is None:
            reasons.append("no recompute run in this round to compare the output with")
        elif run["output"] != reference:
            reasons.append("output differs from recompute")
    return reasons


def _median_ms(values: Sequence[float]) -> float | None:
    return statistics.median(values) * 1e3 if values else None


def summarize(runs: Sequence[dict[str, Any]], rtts: Sequence[float], block: int,
              target: float = PROTOCOL_RTTS) -> dict[str, Any]:
    """Per RTT cell the first prompt's medians (ms) and its extra RTTs against RTT 0.

    Returns ``{"rounds", "valid_rounds", "failed": [{"round", "rtt_ms", "reasons"}],
    "recompute_ttft_ms", "cells": [{"rtt_ms", "runs", "ttft_ms", "wait_ms",
    "prefill_ms", "extra_rtts", "extra_rtts_wait", "within_target",
    "recompute_over_ttft"}]}``. Extra RTTs are paired within a round (``(x(r) - x(0)) /
    r``; None at RTT 0 or without a pair) and their median is over rounds; a cell
    meets the target when its median extra RTTs, to a tenth, are at most ``target``."""
    by_round: dict[int, dict[float | None, dict[str, Any]]] = {}
    for run in runs:
        by_round.setdefault(int(run["round"]), {})[run["rtt_ms"]] = run
    failed = []
    good: dict[int, dict[float | None, dict[str, Any]]] = {}
    for r in sorted(by_round):
        cells = by_round[r]
        rec = cells.get(None)
        reference = rec["output"] if rec is not None and not run_failures(rec, None, block) \
            else None
        for key in [*rtts, None]:
            run = cells.get(key)
            reasons = run_failures(run, reference, block) if run is not None else ["not run"]
            if reasons:
                failed.append({"round": r, "rtt_ms": key, "reasons": reasons})
            else:
                good.setdefault(r, {})[key] = run
    out_cells = []
    recompute = [g[None]["ttft_s"] for g in good.values() if None in g]
    for rtt in rtts:
        mine = [g[rtt] for g in good.values() if rtt in g]

        def extra(key: str, rtt: float = rtt) -> float | None:
            if rtt <= 0:
                return None
            pairs = [(g[rtt][key] - g[0.0][key]) / (rtt / 1e3) for g in good.values()
                     if rtt in g and 0.0 in g and g[rtt][key] and g[0.0][key]]
            return statistics.median(pairs) if pairs else None

        over = [g[None]["ttft_s"] / g[rtt]["ttft_s"] for g in good.values()
                if rtt in g and None in g]
        ttft_extra = extra("ttft_s")
        out_cells.append({
            "rtt_ms": rtt, "runs": len(mine),
            "ttft_ms": _median_ms([m["ttft_s"] for m in mine]),
            "wait_ms": _median_ms([m["queued_s"] for m in mine if m.get("queued_s")]),
            "prefill_ms": _median_ms([m["prefill_s"] for m in mine if m.get("prefill_s")]),
            "extra_rtts": ttft_extra, "extra_rtts_wait": extra("queued_s"),
            "within_target": None if ttft_extra is None else round(ttft_extra, 1) <= target,
            "recompute_over_ttft": statistics.median(over) if over else None,
        })
    complete = [r for r, g in good.items() if all(k in g for k in [*rtts, None])]
    return {"rounds": len(by_round), "valid_rounds": len(complete), "failed": failed,
            "target_rtts": target,
            "recompute_ttft_ms": _median_ms(recompute), "cells": out_cells}


def run(plan: EngineDistancePlan, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Every tier's rounds: ``{"plan", "model_dir", "tiers": {name: run_tier(...)}}``."""
    from kvstore_tiers.tools.demo.models import resolve_model

    progress(f"engine at distance: preparing model {plan.model}")
    model_dir = str(resolve_model(plan.model))
    plan.log_dir.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"plan": plan.describe(), "model_dir": model_dir, "tiers": {}}
    t0 = time.monotonic()
    with open(plan.log_dir / "runs.jsonl", "w") as log:
        for name in plan.tiers:
            out["tiers"][name] = run_tier(plan, name, model_dir, log, progress)
    out["seconds"] = time.monotonic() - t0
    return out


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def table(result: dict[str, Any]) -> list[Any]:
    """Per tier: the first prompt's TTFT and its parts per RTT, the extra RTTs against
    RTT 0 and the target, recompute beside; then the failed runs, if any."""
    from rich.table import Table

    out = []
    for name, res in result["tiers"].items():
        s = res["summary"]
        target = s["target_rtts"]
        closes = res["closes_connections"]
        server = res["server"] + (", closes connections" if closes else "")
        t = Table(title=f"{name} ({server}): a fresh engine's first prompt from the tier at "
                  f"distance ({result['plan']['model']}; {s['valid_rounds']} of "
                  f"{s['rounds']} rounds complete; ms, median over rounds)",
                  caption="RTT 0: the same delaying proxy adding no delay. + RTTs: (x(RTT) - "
                  "x(0)) / RTT paired per round, median; target: at most the protocol's "
                  f"{target} (its waves of existence checks and GETs"
                  + (", each wave on new connections" if closes else "")
                  + "). recompute / TTFT > 1: the tier wins.")
        for col in ("RTT ms", "runs", "TTFT", "wait for the tier", "forward pass",
                    "+ RTTs (TTFT)", "+ RTTs (wait)", f"<= {target}", "recompute / TTFT"):
            t.add_column(col, justify="right")
        for c in s["cells"]:
            ok = c["within_target"]
            t.add_row(f"{c['rtt_ms']:g}", str(c["runs"]), _ms(c["ttft_ms"]), _ms(c["wait_ms"]),
                      _ms(c["prefill_ms"]), _x(c["extra_rtts"]), _x(c["extra_rtts_wait"]),
                      "-" if ok is None else ("yes" if ok else "NO"),
                      "-" if c["recompute_over_ttft"] is None
                      else f"{c['recompute_over_ttft']:.2f}x")
        t.add_row("no tier", "-", _ms(s["recompute_ttft_ms"]), "-", "-", "-", "-", "-", "-")
        out.append(t)
        if s["failed"]:
            f = Table(title=f"{name}: FAILED runs (left out of the figures)")
            for col in ("round", "RTT ms", "why"):
                f.add_column(col)
            for item in s["failed"]:
                rtt = item["rtt_ms"]
                f.add_row(str(item["round"] + 1), RECOMPUTE if rtt is None else f"{rtt:g}",
                          "; ".join(item["reasons"]))
            out.append(f)
    return out
