"""A real vLLM engine cut off the shared tier answers as before (issue 52).

One host runs a real engine (tests/fleet/engine_host.py: ``vllm.LLM`` on the
e2e tests' tiny model, greedy) with the shared redis-server of another
namespace as its tier, and serves the e2e prompts in turn, its own caches
dropped before each, so each request's prefix comes from the tier or is
recomputed. Netfilter drops every packet between it and the server for a
while, then lets them through. What must hold:

* every output, before, during and after the cut, is the output of the same
  model and prompt on an engine without any KV connector;
* before the cut every request is served from the tier; during it a request
  is recomputed, the tier's breaker opens, and no request waits longer than
  the backend's timeouts for its blocks; after the heal the breaker closes and
  requests are served from the tier again.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from kvstore_tiers.tools.demo.runner import phase_env, phase_request
from tests.netns import Fabric

from .conftest import REPORTS, TIMELINES
from .shared import SharedRedis
from .test_partition import BREAKER, LOOKUP_BOUND_S, HostProcess, cut_and_heal

pytestmark = pytest.mark.engine

CUT_S, AFTER_S = 10.0, 6.0  # a request meeting the dead link waits up to 3 s: room for several
OPEN = 2  # vllm:kvstore_circuit_state


def _first(reqs: list[dict[str, Any]], t_from: float) -> float | None:
    return round(reqs[0]["t2"] - t_from, 2) if reqs else None


def _timeline(report: dict[str, Any], t_cut: float, t_heal: float) -> dict[str, Any]:
    reqs = report["requests"]
    # a request that was running when the link died met the cut: "during"
    during = [r for r in reqs if r["t2"] >= t_cut and r["t0"] < t_heal]
    after = [r for r in reqs if r["t0"] >= t_heal]
    return {
        "before": [r for r in reqs if r["t2"] < t_cut],
        "during": during,
        "after": after,
        "first_recompute_s": _first([r for r in during if not r["external_hit_tokens"]], t_cut),
        "breaker_open_s": _first([r for r in during if r["circuit_state"] == OPEN], t_cut),
        "first_hit_after_heal_s": _first([r for r in after if r["external_hit_tokens"]], t_cut),
        "heal_s": round(t_heal - t_cut, 2),
        "slowest_generate_during_s": max((r["t2"] - r["t1"] for r in during), default=0.0),
        "slowest_reset_during_s": max((r["t1"] - r["t0"] for r in during), default=0.0),
    }


def _describe(t: dict[str, Any]) -> list[str]:
    def at(v: float | None) -> str:
        return "never" if v is None else f"{v:+.2f}s"

    lines = [f"engine (redis): cut at +0.00s, heal at {at(t['heal_s'])}; first recompute "
             f"{at(t['first_recompute_s'])}, breaker seen open {at(t['breaker_open_s'])}, "
             f"first hit after heal {at(t['first_hit_after_heal_s'])}"]
    for label in ("before", "during", "after"):
        reqs = t[label]
        lines.append(f"  {label:>6}: {len(reqs)} requests, "
                     f"{sum(1 for r in reqs if r['external_hit_tokens'])} served from the tier, "
                     f"outputs as without a connector: {t[label + '_same']}")
    last = t["during"][-1] if t["during"] else {"load_failures": 0, "stores_dropped": 0}
    lines.append(f"  by the heal: {last['load_failures']} failed loads, "
                 f"{last['stores_dropped']} stores dropped")
    lines.append(f"  slowest during the cut: generate {t['slowest_generate_during_s']:.2f}s, "
                 f"dropping the local caches (draining the tier's jobs) "
                 f"{t['slowest_reset_during_s']:.2f}s")
    return lines


@pytest.mark.timeout(600)  # one engine start and one no-connector baseline (~20 s each)
def test_an_engine_cut_off_the_shared_tier_gives_the_same_outputs(
        fabric: Fabric, tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from kvstore_tiers.tools.demo.models import tiny_llama_model_dir
    from tests.e2e.e2e_helpers import outputs, phase_spec, run

    model = tiny_llama_model_dir(tmp_path / "tiny-llama", seed=0)
    host = fabric.add_host("engine")
    redis = SharedRedis()
    redis.start(fabric, tmp_path / "redis", reach_from=host.netns)
    spec = phase_spec("engine", model, [{**redis.tier(fabric), **BREAKER}])
    (tmp_path / "engine").mkdir()
    engine = HostProcess(fabric, host.netns, "engine", phase_request(spec),
                         tmp_path / "engine.log", module="tests.fleet.engine_host",
                         env=phase_env(spec, tmp_path / "engine"))
    # meanwhile, in this namespace: the same engine without a connector
    baseline = outputs(run("baseline", model, None, tmp_path / "runs"))
    engine.read("ready", timeout_s=300)
    engine.say("go")
    time.sleep(2.0)
    t_cut, t_heal = cut_and_heal(fabric, "engine", CUT_S, AFTER_S)
    engine.say("stop")
    report = engine.read("report", timeout_s=120)

    t = _timeline(report, t_cut, t_heal)
    for label in ("before", "during", "after"):
        t[label + "_same"] = all(r["output_token_ids"] == baseline[r["prompt"]]
                                 for r in t[label])
    TIMELINES["engine"] = _describe(t)
    REPORTS["engine"] = t
    assert all(r["output_token_ids"] == baseline[r["prompt"]] for r in report["warm"])
    assert t["before_same"] and t["during_same"] and t["after_same"], t
    # before: every request's prefix from the tier
    assert t["before"] and all(r["external_hit_tokens"] for r in t["before"]), t["before"]
    # during: it kept answering, recomputing; its breaker opened; nothing waited
    # longer than the backend's own timeouts
    assert len(t["during"]) >= 3, t["during"]
    assert t["first_recompute_s"] is not None, t
    assert t["breaker_open_s"] is not None, t
    assert t["slowest_generate_during_s"] < LOOKUP_BOUND_S, t
    # after: the breaker closed, and the tier serves again
    assert t["first_hit_after_heal_s"] is not None, t
    assert t["after"][-1]["circuit_state"] == 0, t["after"][-1]
