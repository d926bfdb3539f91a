"""One demo/test phase: a fresh vLLM engine in THIS process, prompts sent one by one.

Run as ``python -m kvstore_tiers.tools.demo.phase REQUEST.json RESULT.json``; the
parent (:mod:`kvstore_tiers.tools.demo.runner`) starts one such process per phase so
every phase begins with empty GPU/CPU caches and only the secondary tier
(shared storage) carries state between phases.

Per prompt it records vLLM's own numbers: the engine-measured time to first
token (``RequestOutput.metrics.first_token_latency``), split by the engine
core's timestamps into the time the request waited before its first
schedule (``queued_s``: in a warm phase, the tier's lookups and its load
into the CPU primary) and from there to the first token (``prefill_s``: the
forward pass over the tokens not served, the copy into the KV cache
included), and deltas of vLLM's
Prometheus counters around the request: ``vllm:prefix_cache_hits`` (local
GPU prefix cache), ``vllm:external_prefix_cache_hits`` (tokens the
OffloadingConnector served, i.e. from the CPU primary or a secondary tier),
``vllm:kv_offload_tiering_read_bytes`` / ``write_bytes`` (secondary tiers,
summed over tiers). Stores to the tiers finish asynchronously, so after each
prompt the phase sends tiny "flush" requests (each makes the engine step and
collect finished jobs) until the written-bytes counter settles, then
attributes the writes to that prompt.
At the end, ``tier_metrics`` keeps those two and
``vllm:kv_offload_tiering_chunk_hits`` per tier, as vLLM labels them.

Progress goes, one JSON object per line, to ``request["events_path"]``.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time
from typing import Any

# Counter names read from vllm.LLM.get_metrics()
LOCAL_HITS = "vllm:prefix_cache_hits"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits"
TIER_READ_BYTES = "vllm:kv_offload_tiering_read_bytes"
TIER_WRITE_BYTES = "vllm:kv_offload_tiering_write_bytes"
ACTIVE_CASCADES = "vllm:kv_offload_tiering_active_cascade_jobs"
ACTIVE_PROMOTIONS = "vllm:kv_offload_tiering_active_promotion_jobs"
CHUNK_HITS = "vllm:kv_offload_tiering_chunk_hits"
KVSTORE_PREFIX = "vllm:kvstore_"

_WATCHED = (LOCAL_HITS, EXTERNAL_HITS, TIER_READ_BYTES, TIER_WRITE_BYTES)
#: vLLM's counters labeled by secondary tier ("1:fs", "2:redis": list position and type).
_PER_TIER = (TIER_READ_BYTES, TIER_WRITE_BYTES, CHUNK_HITS)


class _Events:
    def __init__(self, path: str | None) -> None:
        self._f = open(path, "a", buffering=1) if path else None  # noqa: SIM115

    def emit(self, **event: Any) -> None:
        if self._f is not None:
            self._f.write(json.dumps(event) + "\n")

    def close(self) -> None:
        if self._f is not None:
            self._f.close()


def _snapshot(llm: Any) -> dict[str, float]:
    """Sum of each watched counter/gauge over all label sets (tiers, engines)."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        name = m.name
        if name in _WATCHED or name.startswith(KVSTORE_PREFIX) or name in (
            ACTIVE_CASCADES,
            ACTIVE_PROMOTIONS,
        ):
            value = getattr(m, "value", None)
            if isinstance(value, int | float):
                out[name] = out.get(name, 0.0) + float(value)
    return out


def _per_tier(llm: Any) -> dict[str, dict[str, float]]:
    """``{counter: {tier label: value}}`` of the :data:`_PER_TIER` counters, summed over engines."""
    out: dict[str, dict[str, float]] = {}
    for m in llm.get_metrics():
        tier = m.labels.get("tier") if m.name in _PER_TIER else None
        value = getattr(m, "value", None)
        if tier is not None and isinstance(value, int | float):
            per = out.setdefault(m.name, {})
            per[tier] = per.get(tier, 0.0) + float(value)
    return out


def _delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def _settle(llm: Any, flush_prompt: list[int], timeout_s: float) -> dict[str, float]:
    """Step the engine with tiny requests until tier writes have settled."""
    from vllm import SamplingParams, TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=1)
    deadline = time.monotonic() + timeout_s
    last = _snapshot(llm)
    stable = 0
    while time.monotonic() < deadline:
        llm.generate([TokensPrompt(prompt_token_ids=flush_prompt)], sp, use_tqdm=False)
        time.sleep(0.05)
        snap = _snapshot(llm)
        busy = snap.get(ACTIVE_CASCADES, 0.0) > 0 or snap.get(ACTIVE_PROMOTIONS, 0.0) > 0
        if not busy and snap.get(TIER_WRITE_BYTES, 0.0) == last.get(TIER_WRITE_BYTES, 0.0):
            stable += 1
            if stable >= 3:
                return snap
        else:
            stable = 0
        last = snap
    return last


def _span(metrics: Any, start: str, end: str) -> float | None:
    """``end - start`` of two of vLLM's engine-core timestamps (None: either unset)."""
    a = getattr(metrics, start, None) if metrics else None
    b = getattr(metrics, end, None) if metrics else None
    return float(b - a) if a and b else None


def build_llm(request: dict[str, Any]) -> Any:
    """The vLLM engine for ``request`` (connector only if ``secondary_tiers`` is not None)."""
    from vllm import LLM

    kwargs: dict[str, Any] = {
        "model": request["model"],
        "dtype": request.get("dtype", "auto"),
        "kv_cache_dtype": request.get("kv_cache_dtype", "auto"),
        "max_model_len": request.get("max_model_len", 4096),
        # torch.compile would add minutes of startup on a small CPU box
        "enforce_eager": True,
        "disable_log_stats": False,  # get_metrics() and per-request TTFT need stats
        "seed": 0,
        "max_num_seqs": 4,
        # On CPU this is the fraction of host memory vLLM insists is free at
        # start-up; the KV cache size itself comes from VLLM_CPU_KVCACHE_SPACE.
        # Keep it low so parallel test processes and the demo coexist.
        "gpu_memory_utilization": float(request.get("memory_utilization", 0.25)),
    }
    if request.get("single_process"):
        # Scheduler and worker in this process: saves two interpreter
        # start-ups + vLLM imports (~20 s on 2 cores). Used by the fast tests.
        kwargs["distributed_executor_backend"] = "uni"
    tiers = request.get("secondary_tiers")
    if tiers is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "TieringOffloadingSpec",
                "cpu_bytes_to_use": int(request.get("cpu_bytes", 256 << 20)),
                "block_size": int(request.get("block_size", 128)),
                "secondary_tiers": tiers,
            },
        }
    return LLM(**kwargs)


def resolved_tier_classes(tiers: list[dict[str, Any]] | None) -> dict[str, str]:
    """``type -> module.Class`` as vLLM's tier factory resolves it in this process.

    Always includes ``"fs"``, to show whose fs tier that name means here (ours
    when the ``kvstore_tiers`` plugin ran, vLLM's otherwise)."""
    try:
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    except Exception:
        return {}
    out: dict[str, str] = {}
    for cfg in [{"type": "fs"}, *(tiers or [])]:
        try:
            cls = SecondaryTierFactory.get_tier_class(dict(cfg))
            out[cfg["type"]] = f"{cls.__module__}.{cls.__qualname__}"
        except Exception as exc:
            out[cfg["type"]] = f"error: {exc}"
    return out


def run(request: dict[str, Any]) -> dict[str, Any]:
    """Run one phase in this process; return the JSON-able result."""
    from vllm import SamplingParams, TokensPrompt

    from kvstore_tiers.tools.demo.prompts import PromptPlan, build_prompts

    events = _Events(request.get("events_path"))
    try:
        events.emit(stage="engine", message="starting vLLM engine")
        t0 = time.monotonic()
        llm = build_llm(request)
        load_s = time.monotonic() - t0
        # after the engine exists: vLLM has loaded the general plugins here
        tier_classes = resolved_tier_classes(request.get("secondary_tiers"))
        prompts = build_prompts(llm.get_tokenizer(), PromptPlan(**request["plan"]))
        sp = SamplingParams(temperature=0.0, max_tokens=int(request.get("max_tokens", 8)))
        with_connector = request.get("secondary_tiers") is not None
        # A short prompt that matches nothing and fills no block: stepping it
        # submits deferred stores and collects finished tier jobs.
        flush_prompt = [7 + (i % 5) for i in range(8)]
        # Warm-up (not measured): the first forward passes of a fresh CPU
        # engine pay one-time kernel/allocator costs that would otherwise be
        # charged to prompt 1 of the cold phase only (the warm phase's prompt
        # 1 computes few tokens), inflating the speed-up. Its tokens share no
        # prefix with the demo prompts.
        n_warmup = int(request.get("warmup_tokens", 300))
        if n_warmup > 0:
            events.emit(stage="warmup", message="warm-up request")
            vocab = max(len(llm.get_tokenizer()) - 100, 200)
            warmup = [50 + (i * 7919) % vocab for i in range(n_warmup)]
            llm.generate([TokensPrompt(prompt_token_ids=warmup)],
                         SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
            if with_connector:
                _settle(llm, flush_prompt, 10.0)
        results = []
        for i, ids in enumerate(prompts):
            events.emit(stage="prompt", index=i, total=len(prompts), tokens=len(ids))
            before = _snapshot(llm)
            t = time.monotonic()
            out = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
            wall = time.monotonic() - t
            served = _snapshot(llm)
            after = (
                _settle(llm, flush_prompt, float(request.get("settle_timeout_s", 10.0)))
                if with_connector
                else served
            )
            metrics = getattr(out, "metrics", None)
            ttft = getattr(metrics, "first_token_latency", None) if metrics else None
            results.append(
                {
                    "prompt_tokens": len(out.prompt_token_ids or ids),
                    "output_token_ids": list(out.outputs[0].token_ids),
                    "output_text": out.outputs[0].text,
                    "ttft_s": float(ttft) if ttft else None,
                    "queued_s": _span(metrics, "queued_ts", "scheduled_ts"),
                    "prefill_s": _span(metrics, "scheduled_ts", "first_token_ts"),
                    "wall_s": wall,
                    "num_cached_tokens": out.num_cached_tokens,
                    "local_hit_tokens": int(_delta(served, before, LOCAL_HITS)),
                    "external_hit_tokens": int(_delta(served, before, EXTERNAL_HITS)),
                    "tier_read_bytes": int(_delta(served, before, TIER_READ_BYTES)),
                    "tier_write_bytes": int(_delta(after, before, TIER_WRITE_BYTES)),
                }
            )
        final = _settle(llm, flush_prompt, 10.0) if with_connector else _snapshot(llm)
        per_tier = _per_tier(llm)
        events.emit(stage="shutdown", message="stopping engine")
        _shutdown(llm)
        return {
            "engine_load_s": load_s,
            "prompts": results,
            "metrics": final,
            "tier_metrics": per_tier,
            "tier_stats": _read_stats_files(os.environ.get("KVSTORE_TIERS_STATS_DIR")),
            "tier_classes": tier_classes,
        }
    finally:
        events.emit(stage="done")
        events.close()


def _shutdown(llm: Any) -> None:
    """Stop the engine core now, so tiers shut down (and write stats files)."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:  # best effort: process exit stops it too
        print(f"kvstore demo: engine shutdown: {exc!r}", file=sys.stderr)


def _read_stats_files(directory: str | None) -> list[dict[str, Any]]:
    """Counters our tiers write at shutdown (``KVSTORE_TIERS_STATS_DIR``)."""
    if not directory:
        return []
    # The engine core has exited when shutdown() returns; allow a moment for
    # a slow filesystem, not more (tiers that are not ours write no file).
    deadline = time.monotonic() + 1.0
    files: list[str] = []
    while time.monotonic() < deadline:
        files = sorted(glob.glob(os.path.join(directory, "*.json")))
        if files:
            break
        time.sleep(0.2)
    out = []
    for path in files:
        try:
            with open(path) as f:
                out.append(json.load(f))
        except (OSError, ValueError):
            continue
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m kvstore_tiers.tools.demo.phase REQUEST.json RESULT.json",
              file=sys.stderr)
        return 2
    with open(args[0]) as f:
        request = json.load(f)
    result = run(request)
    tmp = args[1] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, args[1])
    return 0


if __name__ == "__main__":
    # vLLM starts its engine core with multiprocessing 'spawn': keep the guard.
    sys.exit(main())
