"""Two checkouts A/B'd by alternating whole ``kvstore-tiers bench`` processes.

``scripts/bench-ab.sh OLD NEW`` runs the bench with ``PYTHONPATH`` at one
checkout, then the other, swapping the order every round (AB, BA, ...), and
writes each result to ``DIR/<round>-<A|B>/bench.json``. :func:`compare` pairs
round ``i`` of B with round ``i`` of A for every figure both report and gives
B/A balanced over AB/BA round pairs (:mod:`.pairing`), with an approximate
95 % interval once there are enough pairs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

KiB, MiB = 1 << 10, 1 << 20


def _size(c: int) -> str:
    return f"{c // KiB} KiB" if c < MiB else f"{c // MiB} MiB"


def figures(result: dict[str, Any]) -> Iterator[tuple[str, float, bool]]:
    """(name, value, higher is better) of every tier figure in one bench result."""
    fs = result.get("fs") or {}
    for r in fs.get("throughput", ()):
        cell = f"fs {_size(r['chunk_bytes'])} x{r['requests']}"
        yield f"{cell} store GB/s", r["kvstore_store_gbps"], True
        yield f"{cell} load GB/s", r["kvstore_load_gbps"], True
        for op in ("store", "load"):
            if f"kvstore_{op}_cpu_s_per_gb" in r:
                yield f"{cell} {op} CPU s/GB", r[f"kvstore_{op}_cpu_s_per_gb"], False
            if f"kvstore_{op}_io_cpu_s_per_gb" in r:
                yield f"{cell} {op} I/O CPU s/GB", r[f"kvstore_{op}_io_cpu_s_per_gb"], False
    for method, d in (fs.get("scheduler_gc_random_phase") or {}).get("kvstore", {}).items():
        yield f"fs scheduler {method} p99 us", d["p99_us"], False
    b = (result.get("redis") or {}).get("bandwidth") or {}
    for op in ("set", "get", "get_transfer"):
        if f"tier_{op}_MiBps" in b:
            yield f"redis {op.upper()} MiB/s", b[f"tier_{op}_MiBps"], True
    g = (result.get("s3") or {}).get("gbps") or {}
    for op in ("store", "load", "load_transfer"):
        if f"tier_{op}" in g:
            yield f"s3 {op} GB/s", g[f"tier_{op}"], True


def load_rounds(directory: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The A and B results of ``directory``, round by round (``<i>-A``, ``<i>-B``)."""
    a, b = [], []
    i = 1
    while (directory / f"{i}-A" / "bench.json").exists():
        a.append(json.loads((directory / f"{i}-A" / "bench.json").read_text()))
        b.append(json.loads((directory / f"{i}-B" / "bench.json").read_text()))
        i += 1
    if not a:
        raise FileNotFoundError(f"no 1-A/bench.json in {directory}")
    return a, b


def compare(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per figure: the median of A and of B, and B/A (``x``; for a time, A/B, so
    above 1 is better for B either way) with its interval."""
    from statistics import median

    from kvstore_tiers.tools.bench.pairing import ratio_interval

    rows = []
    per_round = [(dict((n, v) for n, v, _ in figures(ra)), dict((n, v) for n, v, _ in figures(rb)))
                 for ra, rb in zip(a, b, strict=True)]
    higher = {n: h for n, _, h in figures(a[0])}
    for name, better_high in higher.items():
        pairs = [(fa[name], fb[name]) for fa, fb in per_round if name in fa and name in fb]
        if len(pairs) != len(per_round):
            continue  # not in every round: nothing to pair
        va, vb = [p[0] for p in pairs], [p[1] for p in pairs]
        x, low, high = ratio_interval(vb, va) if better_high else ratio_interval(va, vb)
        rows.append({"figure": name, "A": median(va), "B": median(vb), "x": x,
                     "ci95": [low, high], "higher_is_better": better_high})
    return rows


def table(rows: list[dict[str, Any]], a_code: dict[str, Any], b_code: dict[str, Any]) -> Any:
    """The comparison as a rich table."""
    from rich.table import Table

    def who(code: dict[str, Any]) -> str:
        return f"{code.get('path', '?')} {code.get('commit', '')[:10]}".strip()

    t = Table(title=f"A/B: A = {who(a_code)}, B = {who(b_code)} (x > 1: B better; balanced "
              "over AB/BA round pairs, approximate 95 % interval)")
    for col in ("figure", "A", "B", "x", "95 % interval"):
        t.add_column(col, justify="right")
    for r in rows:
        low, high = r["ci95"]
        t.add_row(r["figure"], f"{r['A']:.3g}", f"{r['B']:.3g}", f"{r['x']:.2f}",
                  "-" if low != low else f"{low:.2f}-{high:.2f}")  # nan: too few pairs
    return t
