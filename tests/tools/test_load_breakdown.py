"""``bench --load-trace`` / ``--load-trace-summary``: a load trace summarised per phase."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kvstore_tiers.tools.bench import load_breakdown


def _batch(start: float, call: float, read: float, read_end: float, frames: list[float],
           call_end: float, end: float, slots: list[int]) -> dict[str, Any]:
    marks = [["read", read], ["read_end", read_end], *(["frame", f] for f in frames)]
    return {"thread": "kvstore_fs_l0", "slots": slots, "start": start, "call": call,
            "call_end": call_end, "end": end, "marks": marks}


#: Two fs jobs (ms: queue 1 and 3, read 2+3 and 2, verify 0.8+0.3 and 0.3, ...),
#: two jobs of vLLM's tier seen from outside (totals 5 and 9), one job of a
#: backend that marks nothing inside its batch call.
FIXTURE = [
    {"pid": 1, "tier": "fs", "job": 1, "chunks": 3, "ok": True, "submit": 10.0,
     "batches": [_batch(10.001, 10.0011, 10.0012, 10.0032, [10.0035, 10.0040], 10.0041,
                        10.0042, [0, 2]),
                 _batch(10.0015, 10.0016, 10.0017, 10.0047, [10.0050], 10.0051, 10.0052,
                        [2, 3])],
     "published": 10.0053, "published_by": "kvstore_fs_l1", "picked": 10.0060},
    {"pid": 1, "tier": "fs", "job": 3, "chunks": 1, "ok": True, "submit": 20.0,
     "batches": [_batch(20.003, 20.0031, 20.0032, 20.0052, [20.0055], 20.0056, 20.0057,
                        [0, 1])],
     "published": 20.0060, "published_by": "kvstore_fs_l0", "picked": 20.0070},
    {"pid": 1, "tier": "vllm_fs", "job": 1, "chunks": 3, "submit": 5.0, "picked": 5.005,
     "observed": "outside"},
    {"pid": 1, "tier": "vllm_fs", "job": 3, "chunks": 1, "submit": 6.0, "picked": 6.009,
     "observed": "outside"},
    {"pid": 1, "tier": "redis", "job": 7, "chunks": 1, "ok": True, "submit": 1.0,
     "batches": [{"thread": "kvstore_redis_l0", "slots": [0, 1], "start": 1.0002,
                  "call": 1.0003, "call_end": 1.0008, "end": 1.0009, "marks": []}],
     "published": 1.001, "picked": 1.002},
]


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in FIXTURE) + "\n")
    return path


def test_the_phases_of_a_fixture_trace(trace_file: Path) -> None:
    s = load_breakdown.summarise(load_breakdown.read_trace(trace_file))
    fs, stock, redis = s["fs"], s["vllm_fs"], s["redis"]
    assert fs["jobs"] == 2 and fs["chunks"] == 2
    expect = {"queue": (1.0, 3.0), "transfer": (4.2, 2.7), "read": (5.0, 2.0),
              "verify": (1.1, 0.3), "publish": (0.1, 0.3), "pickup": (0.7, 1.0),
              "total": (6.0, 7.0)}
    for phase, (a, b) in expect.items():
        assert fs[phase]["jobs"] == 2
        assert fs[phase]["median_ms"] == pytest.approx((a + b) / 2, abs=1e-6), phase
        assert fs[phase]["p90_ms"] == pytest.approx(min(a, b) + 0.9 * abs(a - b), abs=1e-6)
    # vLLM's tier: only the two endpoints seen from outside.
    assert stock["total"]["median_ms"] == pytest.approx(7.0)
    assert stock["total"]["p90_ms"] == pytest.approx(8.6)
    assert all(stock[p] is None for p in expect if p != "total")
    # A backend that marks nothing: its batch call is the read; no verify figure.
    assert redis["read"]["median_ms"] == pytest.approx(0.5)
    assert redis["verify"] is None


def test_the_summary_command_prints_the_table(trace_file: Path) -> None:
    from kvstore_tiers.cli.bench import bench

    out = CliRunner().invoke(bench, ["--load-trace-summary", str(trace_file)])
    assert out.exit_code == 0, out.output
    assert "queue wait" in out.output and "vllm_fs median" in out.output
    assert "2.00" in out.output and "7.00" in out.output  # fs queue, stock total medians


def test_a_line_that_is_not_json_is_named(tmp_path: Path) -> None:
    from kvstore_tiers.cli.bench import bench

    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(FIXTURE[0]) + "\n{not json\n")
    out = CliRunner().invoke(bench, ["--load-trace-summary", str(path)])
    assert out.exit_code == 2 and "bad.jsonl:2" in out.output


@pytest.mark.parametrize("busy", [False, True])
def test_a_tiny_run_traces_ours_and_observes_vllms(tmp_path: Path, monkeypatch, busy) -> None:
    from kvstore_tiers.tools.bench import fs_bench

    spun: list[float] = []
    real_spin = fs_bench.spin
    monkeypatch.setattr(fs_bench, "spin", lambda s: spun.append(s) or real_spin(s))
    trace = tmp_path / "out" / "load-trace.jsonl"
    result = load_breakdown.run(tmp_path, 16 * 1024, 256 * 1024, 1, trace,
                                progress=lambda _m: None, busy=busy)
    assert bool(spun) is busy and result["busy_scheduler"] is busy
    s = result["summary"]
    assert s["fs"]["jobs"] == 1 and s["vllm_fs"]["jobs"] == 1
    assert all(s["fs"][p] is not None for p, _label in load_breakdown.PHASES)
    assert s["vllm_fs"]["total"]["median_ms"] > 0 and s["vllm_fs"]["queue"] is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the tiers' roots removed


def test_busy_scheduler_belongs_to_the_load_trace() -> None:
    from kvstore_tiers.cli.bench import bench

    out = CliRunner().invoke(bench, ["--busy-scheduler", "--quick"])
    assert out.exit_code == 2 and "--busy-scheduler only applies to --load-trace" in out.output
