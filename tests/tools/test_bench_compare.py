"""``bench --compare``: two checkouts' alternating results paired round by round."""

from __future__ import annotations

import json
import math
from pathlib import Path

from click.testing import CliRunner

from kvstore_tiers.cli import main
from kvstore_tiers.tools.bench.compare import compare, load_rounds


def _result(store: float, p99: float, redis_get: float | None, commit: str) -> dict:
    out: dict = {
        "code": {"path": f"/src/{commit}", "commit": commit},
        "fs": {"throughput": [{"chunk_bytes": 256 << 10, "requests": 1,
                               "kvstore_store_gbps": store, "kvstore_load_gbps": 1.0}],
               "scheduler_gc_random_phase": {"kvstore": {"lookup": {"p99_us": p99}}}},
    }
    if redis_get is not None:
        out["redis"] = {"bandwidth": {"tier_get_MiBps": redis_get}}
    return out


def _write(directory: Path, i: int, side: str, result: dict) -> None:
    (directory / f"{i}-{side}").mkdir(parents=True)
    (directory / f"{i}-{side}" / "bench.json").write_text(json.dumps(result))


def test_b_twice_as_fast_and_half_the_time_is_2x(tmp_path: Path) -> None:
    for i in range(1, 5):
        _write(tmp_path, i, "A", _result(1.0 + i / 100, 4.0, 100.0, "aaaa"))
        # redis only in some of B's rounds: not paired, left out
        _write(tmp_path, i, "B", _result(2.0 * (1.0 + i / 100), 2.0,
                                         200.0 if i % 2 else None, "bbbb"))
    a, b = load_rounds(tmp_path)
    rows = {r["figure"]: r for r in compare(a, b)}
    assert math.isclose(rows["fs 256 KiB x1 store GB/s"]["x"], 2.0)
    assert math.isclose(rows["fs 256 KiB x1 load GB/s"]["x"], 1.0)
    assert math.isclose(rows["fs scheduler lookup p99 us"]["x"], 2.0)  # a time: A/B
    assert "redis GET MiB/s" not in rows
    cli = CliRunner().invoke(main, ["bench", "--compare", str(tmp_path)])
    assert cli.exit_code == 0, cli.output
    assert "aaaa" in cli.output and "bbbb" in cli.output and "4 rounds" in cli.output
    saved = json.loads((tmp_path / "compare.json").read_text())
    assert saved["rounds"] == 4 and len(saved["figures"]) == 3


def test_cpu_per_gb_cells_are_compared_as_costs(tmp_path: Path) -> None:
    for i in range(1, 3):
        for side, cost in (("A", 0.4), ("B", 0.2)):
            r = _result(1.0, 4.0, None, side.lower() * 4)
            r["fs"]["throughput"][0].update({"kvstore_load_cpu_s_per_gb": cost,
                                             "kvstore_load_io_cpu_s_per_gb": cost / 2})
            _write(tmp_path, i, side, r)
    rows = {r["figure"]: r for r in compare(*load_rounds(tmp_path))}
    # Half the CPU per GB is twice as good, in both figures.
    assert math.isclose(rows["fs 256 KiB x1 load CPU s/GB"]["x"], 2.0)
    assert math.isclose(rows["fs 256 KiB x1 load I/O CPU s/GB"]["x"], 2.0)
