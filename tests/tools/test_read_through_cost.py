"""``tools.bench.read_through_cost``: each arm loads what it should and caches what it should."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")


def test_an_arm_loads_every_block_and_caches_them_with_read_through(
    redis_server: Any, tmp_path: Path
) -> None:
    from kvstore_tiers.tools.bench.read_through_cost import measure

    for read_through in (False, True):
        r = measure(redis_server.url, read_through, blocks=4, chunk_bytes=64 << 10, rounds=2,
                    directory=str(tmp_path))
        assert r["loaded"] == 4 and r["cached"] == (8 if read_through else 0)
        assert r["first_load_s"] > 0 and r["reused_load_s"] > 0 and r["calls"] > 0


def test_the_arms_run_in_their_own_processes_and_report_ratios(tmp_path: Path) -> None:
    if __import__("shutil").which("redis-server") is None:
        pytest.skip("redis-server not installed")
    from kvstore_tiers.tools.bench.read_through_cost import main

    report = main(["--pairs", "1", "--blocks", "2", "--chunk-kib", "64", "--rounds", "2",
                   "--dir", str(tmp_path)])
    on, off = report["runs"]["on"][0], report["runs"]["off"][0]
    assert (on["cached"], off["cached"]) == (4, 0)
    ratio = report["ratios"]["on/off"]["reused_load_s"][0]
    assert ratio == pytest.approx(on["reused_load_s"] / off["reused_load_s"])


@pytest.mark.parametrize("arm", ["on", "=:on", "new=/src:maybe", "new=/src"])
def test_a_malformed_arm_is_refused(arm: str, capsys: pytest.CaptureFixture[str]) -> None:
    from kvstore_tiers.tools.bench.read_through_cost import main

    with pytest.raises(SystemExit) as exc:
        main(["--arm", arm])
    assert exc.value.code == 2 and "NAME=CHECKOUT:on|off" in capsys.readouterr().err
