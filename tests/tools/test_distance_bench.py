"""``bench --distance``: each cell's loads through the delaying proxy (and the capped
link), the raw client beside them, and the bound (RTTs the protocol needs x RTT +
bytes / bandwidth) with measured / bound."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from click.testing import CliRunner

from kvstore_tiers.cli import main
from kvstore_tiers.tools.bench import distance
from kvstore_tiers.tools.netem import capability


def test_the_bound_is_rtts_times_rtt_plus_bytes_over_bandwidth() -> None:
    cells = [{"rtt_ms": 0, "cap_mbit": None, "bytes": 100e6, "raw": 0.5, "first": 0.4,
              "again": 0.25},
             {"rtt_ms": 50, "cap_mbit": None, "bytes": 100e6, "raw": 0.6, "first": 0.8,
              "again": 0.5},
             {"rtt_ms": 20, "cap_mbit": 400, "bytes": 100e6, "raw": 2.1, "first": 2.2,
              "again": 2.1}]
    out = distance.bounds(cells, None, 100, {"raw": 2, "first": 4, "again": 2})
    # Uncapped: the fastest at the lowest RTT sets the bandwidth (100 MB in 0.25 s).
    assert out[0]["bandwidth_Bps"] == pytest.approx(400e6)
    assert out[1]["bound_first"] == pytest.approx(4 * 0.05 + 0.25)
    assert out[1]["x_again"] == pytest.approx(0.5 / (2 * 0.05 + 0.25))
    # Capped: the cap (400 Mbit/s = 50 MB/s).
    assert out[2]["bound_raw"] == pytest.approx(2 * 0.02 + 2.0)
    # What 50 ms added to a fresh engine's load: 0.4 s, 8 RTTs; none at RTT 0 or capped.
    assert out[1]["first_extra_rtts"] == pytest.approx(8.0)
    assert out[0]["first_extra_rtts"] is None and out[2]["first_extra_rtts"] is None


@pytest.mark.parametrize(("keys", "prefetches"), [({}, True),
                                                   ({"lookup_prefetch_bytes": 0}, False),
                                                   ({"lookup_prefetch_bytes": 100 << 20}, False)])
def test_s3_prefetch_covers_the_prefix_or_not(keys: dict[str, int], prefetches: bool) -> None:
    """100 MiB of blocks: the default budget (256 MiB) holds them all; 0 or exactly 100 MiB
    (no room for the frames' headers) does not, and the fresh engine HEADs."""
    plan = distance.DistancePlan(tier_keys=keys, total_mib=100)
    s3 = object.__new__(distance._S3)
    s3.concurrency, s3.closes = 64, False
    s3.prefetches = distance._S3.prefetch_covers(plan)
    assert s3.prefetches is prefetches


def test_rtts_of_each_protocol() -> None:
    s3 = object.__new__(distance._S3)
    s3.concurrency, s3.prefetches = 64, False  # lookups HEAD, then loads GET
    assert (s3.rtts(100, fresh=False), s3.rtts(100, fresh=True)) == (2, 4)
    s3.closes = True  # a server that closes connections: a handshake per request
    assert (s3.rtts(100, fresh=False), s3.rtts(100, fresh=True)) == (4, 8)
    s3.prefetches = True  # lookups GET the prefix, its loads take the bodies: no HEAD wave
    assert (s3.rtts(100, fresh=False), s3.rtts(100, fresh=True)) == (4, 4)
    r = object.__new__(distance._Redis)
    r.threads, r.batch = 8, 8
    assert (r.rtts(100, fresh=False), r.rtts(100, fresh=True)) == (2, 3)


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")
def test_distance_mode_measures_every_cell(tmp_path: Path) -> None:
    cap = capability.unavailable() is None
    args = ["bench", "--distance", "--tier", "redis", "--rtt-ms", "0", "--rtt-ms", "40",
            "--total-mib", "4", "--chunk-kib", "256", "--out", str(tmp_path)]
    args += ["--cap-mbit", "100", "--cap-rtt-ms", "0"] if cap else ["--cap-mbit", "0"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "distance.json").read_text())
    redis = doc["tiers"]["redis"]
    cells = redis["cells"]
    assert [(c["rtt_ms"], c["cap_mbit"]) for c in cells] == [(0, None), (40, None)] + (
        [(0, 100)] if cap else [])
    assert redis["rtts"] == {"raw": 1, "first": 2, "again": 1}
    for c in cells:
        assert c["bytes"] >= 4 << 20
        for what in ("raw", "first", "again"):
            assert c[what] > 0 and c[f"x_{what}"] == pytest.approx(c[what] / c[f"bound_{what}"])
    far = cells[1]
    # 40 ms away, a fresh engine needs EXISTS then GET: at least two round trips.
    assert far["first"] >= 2 * 0.040 and far["raw"] >= 0.040
    if cap:  # 4 MiB at 100 Mbit/s: 0.34 s at least, whoever moves them
        assert min(cells[2][w] for w in ("raw", "first", "again")) >= 0.3
    assert "remote tiers at distance" in res.output


def test_distance_options_need_distance_and_a_remote_tier() -> None:
    res = CliRunner().invoke(main, ["bench", "--rtt-ms", "5"])
    assert res.exit_code == 2 and "--rtt-ms only apply to --distance" in res.output
    res = CliRunner().invoke(main, ["bench", "--distance", "--tier", "fs"])
    assert res.exit_code == 2 and "--tier s3 or redis" in res.output
    res = CliRunner().invoke(main, ["bench", "--distance", "--quick"])
    assert res.exit_code == 2 and "drop --quick" in res.output
