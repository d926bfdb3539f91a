"""``bench --backpressure``: loads from a tier whose stores cannot keep up, with
``max_store_bytes_in_flight`` at its default and off.

Through vLLM's real manager (:mod:`kvstore_tiers.admin.harness`), an fs tier
whose writes are throttled to ``write_mib_s`` (a slow disk or link; loads are
not throttled). Each round, one request cascades ``flood`` new chunks (more
than the throttled tier can write in a round), then another request looks
up ``hot`` blocks stored in the tier before the flood began and loads the
ones vLLM promotes. Measured per round: the reader's hits, its time from
its first lookup to its rows loaded (rounds with hits), and the chunks the
primary refused to the writer (no room: every row pinned). The two arms run
as whole runs in alternating order (AB, BA, ...).
"""

from __future__ import annotations

import shutil
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvstore_tiers.backends.base import Write, Written
from kvstore_tiers.backends.fs import FileSystemBackend
from kvstore_tiers.tier import KVStoreTier


class _WriteThrottle:
    """Serialises writes at ``rate`` bytes per second across threads (0: off)."""

    def __init__(self) -> None:
        self.rate = 0.0
        self._lock = threading.Lock()
        self._next_free = 0.0

    def wait(self, nbytes: int) -> None:
        if not self.rate:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next_free)
            self._next_free = start + nbytes / self.rate
            delay = self._next_free - now
        time.sleep(delay)


THROTTLE = _WriteThrottle()


class ThrottledFsBackend(FileSystemBackend):
    """fs backend whose stores take at least their bytes / ``THROTTLE.rate``."""

    def write_many(self, writes: Sequence[Write]) -> list[Written]:
        THROTTLE.wait(sum(len(p) for w in writes for p in w.parts))
        return super().write_many(writes)


class ThrottledFsTier(KVStoreTier):
    backend_cls = ThrottledFsBackend


@dataclass
class BackpressurePlan:
    directory: Path
    pairs: int = 3
    rounds: int = 30
    chunk_kib: int = 256
    primary_chunks: int = 64
    flood: int = 8  # chunks a writer cascades per round
    hot: int = 4  # blocks a reader loads from the tier per round
    write_mib_s: float = 16.0


@dataclass
class ArmResult:
    arm: str  # "bounded" (the default bound) or "unbounded" (0)
    order: int
    latency_ms: list[float] = field(default_factory=list)
    hits: int = 0
    asked: int = 0
    refused_by_primary: int = 0
    stored: int = 0
    dropped_backpressure: int = 0
    wrong_bytes: int = 0


def run_arm(plan: BackpressurePlan, arm: str, order: int) -> ArmResult:
    from vllm.v1.kv_offload.base import LookupResult

    from kvstore_tiers.admin.harness import build_harness, make_keys, rows_for

    root = plan.directory / f"{arm}-{order}"
    shutil.rmtree(root, ignore_errors=True)
    row = plan.chunk_kib * 1024
    tier_cfg: dict[str, Any] = {"type": "ThrottledFsTier", "module_path": __name__,
                                "root_dir": str(root)}
    if arm == "unbounded":
        tier_cfg["max_store_bytes_in_flight"] = 0
    h = build_harness([tier_cfg], num_chunks=plan.primary_chunks, chunk_bytes=row,
                      enable_events=False)
    res = ArmResult(arm=arm, order=order)
    THROTTLE.rate = 0
    try:
        hot = make_keys(plan.rounds * plan.hot, seed=1000 + order)
        batch = plan.primary_chunks // 2
        for i in range(0, len(hot), batch):
            h.store_all(hot[i:i + batch], rows_for(hot[i:i + batch], row))
        h.forget_primary()
        THROTTLE.rate = plan.write_mib_s * 2**20
        for r in range(plan.rounds):
            flood = make_keys(plan.flood, seed=10_000 * (order + 1) + r)
            writer = h.new_request()
            with h.locked():
                out = h.manager.prepare_store(flood, writer)
                if out is None:
                    res.refused_by_primary += len(flood)
                else:
                    stored = list(out.keys_to_store)
                    rows = rows_for(stored, row)
                    for cid, data in zip(out.store_spec.chunk_ids, rows, strict=True):
                        h.view[int(cid)] = data
                    h.manager.complete_store(stored, writer)
            h.step()
            wanted = hot[r * plan.hot:(r + 1) * plan.hot]
            reader = h.new_request()
            t0 = time.perf_counter()
            results, _ = h.lookup_until_resolved(wanted, reader)
            hits = [k for k, v in zip(wanted, results, strict=True) if v == LookupResult.HIT]
            if hits:
                loaded = h.load(hits, reader)
                res.wrong_bytes += int(sum(a.tobytes() != b.tobytes()
                                           for a, b in zip(loaded, rows_for(hits, row),
                                                           strict=True)))
                # A round of misses takes no time here; vLLM recomputes them instead.
                res.latency_ms.append((time.perf_counter() - t0) * 1000)
            res.hits += len(hits)
            res.asked += len(wanted)
            h.finish_request(reader)
            h.finish_request(writer)
        THROTTLE.rate = 0
        h.settle(timeout_s=300)
        c = h.tiers[0].counters
        res.stored = c.objects_stored - len(hot)
        res.dropped_backpressure = c.stores_dropped_backpressure
    finally:
        THROTTLE.rate = 0
        h.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    return res


def run(plan: BackpressurePlan, progress: Callable[[str], None] | None = None
        ) -> list[ArmResult]:
    """Every pair runs both arms, in reversed order every other pair."""
    results = []
    for p in range(plan.pairs):
        arms = ("bounded", "unbounded") if p % 2 == 0 else ("unbounded", "bounded")
        for arm in arms:
            if progress:
                progress(f"pair {p + 1}/{plan.pairs}: {arm}")
            results.append(run_arm(plan, arm, len(results)))
    return results


def summarise(results: Sequence[ArmResult]) -> dict[str, dict[str, float | None]]:
    """Per arm: reader latency p50/p99 over the rounds with hits, hit share, primary refusals."""
    out: dict[str, dict[str, float]] = {}
    for arm in ("bounded", "unbounded"):
        rs = [r for r in results if r.arm == arm]
        if not rs:
            continue
        lat = sorted(x for r in rs for x in r.latency_ms)  # empty: no round had a hit
        out[arm] = {
            "latency_p50_ms": statistics.median(lat) if lat else None,
            "latency_p99_ms": lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None,
            "hit_share": sum(r.hits for r in rs) / max(1, sum(r.asked for r in rs)),
            "refused_by_primary": sum(r.refused_by_primary for r in rs),
            "stored": sum(r.stored for r in rs),
            "dropped_backpressure": sum(r.dropped_backpressure for r in rs),
            "wrong_bytes": sum(r.wrong_bytes for r in rs),
        }
    return out


def as_json(plan: BackpressurePlan, results: Sequence[ArmResult]) -> dict[str, Any]:
    plan_d = asdict(plan)
    plan_d["directory"] = str(plan.directory)
    return {"plan": plan_d, "summary": summarise(results),
            "runs": [asdict(r) for r in results]}
