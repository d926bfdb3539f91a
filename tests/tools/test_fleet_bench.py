"""``bench --trace --nodes``: the routing, and a small fleet replay through vLLM's real
manager in two node processes, on a real redis-server and a real moto S3 server,
whose accounting must add up."""

from __future__ import annotations

import importlib.util
import math
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from kvstore_tiers.tools.bench import fleet, routing
from kvstore_tiers.tools.bench.trace_file import TraceRequest, load
from tests.servers import moto_server_bin
from tests.tools.test_trace_bench import CONVERSATION, needs_trace


def _req(*ids: int) -> TraceRequest:
    return TraceRequest(0, 512 * len(ids), 0, ids)


# -- routing ---------------------------------------------------------------------------------
def test_jump_hash_is_consistent_and_even() -> None:
    keys = [routing.affinity_key(_req(1, b), 2) for b in range(4000)]
    for n in range(1, 9):
        for k in keys:
            b = routing.jump_hash(k, n)
            assert 0 <= b < n
            # One more node: a key stays, or moves to the new node, never elsewhere.
            assert routing.jump_hash(k, n + 1) in (b, n)
    spread = Counter(routing.jump_hash(k, 4) for k in keys)
    assert min(spread.values()) > 0.8 * len(keys) / 4


def test_round_robin_deals_in_turn_and_affinity_follows_the_prefix() -> None:
    reqs = [_req(0, 10 + i % 5, 100 + i) for i in range(40)] + [_req(0)]
    assert routing.route(reqs, 3, "round-robin") == [i % 3 for i in range(41)]
    nodes = routing.route(reqs, 4, "affinity", routing.RoutingKnobs(affinity_blocks=2))
    by_prefix: dict[int, set[int]] = {}
    for r, n in zip(reqs, nodes, strict=True):
        by_prefix.setdefault(r.hash_ids[1] if len(r.hash_ids) > 1 else -1, set()).add(n)
    assert all(len(v) == 1 for v in by_prefix.values())
    assert len(set(nodes)) > 1
    # One block: every request shares block 0, so all go to one node.
    one = routing.RoutingKnobs(affinity_blocks=1)
    assert len(set(routing.route(reqs, 4, "affinity", one))) == 1
    with pytest.raises(ValueError, match="routing"):
        routing.route(reqs, 2, "random")


@needs_trace
def test_affinity_spreads_the_conversation_trace() -> None:
    reqs = load(CONVERSATION, limit=2000)
    one = routing.RoutingKnobs(affinity_blocks=1)
    assert len(set(routing.route(reqs, 4, "affinity", one))) == 1
    spread = Counter(routing.route(reqs, 4, "affinity"))
    assert len(spread) == 4 and min(spread.values()) > len(reqs) / 8


def _conversations(n: int, hot: float, turns: int = 4) -> list[TraceRequest]:
    """``n`` requests of conversations of ``turns`` turns, each turn the last one's
    blocks plus one; a share ``hot`` of the conversations starts with the same two
    blocks (a long shared system prompt), the others with their own."""
    out = []
    convs = n // turns
    for c in range(convs):
        head = (1, 2) if c < hot * convs else (1000 + c, 2000 + c)
        for t in range(turns):
            out.append(_req(*head, *(10_000 * (c + 1) + i for i in range(t + 1))))
    # Interleave the conversations as arrivals do: turn t of every conversation
    # before turn t + 1 of any.
    return sorted(out, key=lambda r: len(r.hash_ids))


def _max_over_mean(nodes: list[int], n: int) -> float:
    return routing.balance(nodes, n)["max_over_mean"]


def test_balance_counts_requests_per_node() -> None:
    assert routing.balance([0, 0, 1, 3], 4) == {"requests_per_node": [2, 1, 0, 1],
                                                "max_over_mean": 2.0}


def test_probe_sequence_starts_at_the_affinity_node_and_visits_each_node_once() -> None:
    for key in range(500):
        for n in (2, 4, 7):
            seq = routing.probe_sequence(key * 7919, n)
            assert seq[0] == routing.jump_hash(key * 7919, n)
            assert sorted(seq) == list(range(n))


def test_bounded_loads_hold_at_every_request_and_the_prefixes_that_fit_stay() -> None:
    reqs = _conversations(400, hot=0.6)
    aff = routing.route(reqs, 4, "affinity")
    assert _max_over_mean(aff, 4) > 2  # the shared prefix sends 60 % to one node
    knobs = routing.RoutingKnobs(load_factor=1.25)
    nodes = routing.route(reqs, 4, "bounded", knobs)
    loads = [0] * 4
    for dealt, n in enumerate(nodes):
        loads[n] += 1
        assert max(loads) <= math.ceil(1.25 * (dealt + 1) / 4)
    assert _max_over_mean(nodes, 4) <= 1.25
    # Locality: the prefixes that fit keep their affinity node; the hot one has most
    # of its requests on its own and overflows along its probe sequence.
    aff_of = dict(zip(map(id, reqs), aff, strict=True))
    cold = [(aff_of[id(r)], n) for r, n in zip(reqs, nodes, strict=True)
            if r.hash_ids[:2] != (1, 2)]
    assert sum(a == n for a, n in cold) >= 0.9 * len(cold)
    hot = Counter(n for r, n in zip(reqs, nodes, strict=True) if r.hash_ids[:2] == (1, 2))
    assert hot.most_common(1)[0][0] == routing.jump_hash(routing.affinity_key(reqs[0], 2), 4)
    # With room everywhere, bounded is affinity.
    even = _conversations(400, hot=0.0)
    loose = routing.RoutingKnobs(load_factor=4.0)
    assert routing.route(even, 4, "bounded", loose) == routing.route(even, 4, "affinity")


def test_cache_aware_follows_the_prefix_until_the_load_is_imbalanced() -> None:
    # The shared system prompt is hashed into every key, so prefix hashing sends
    # everything to one node; the cache-aware router matches whole prefixes.
    reqs = _conversations(400, hot=1.0)
    assert _max_over_mean(routing.route(reqs, 4, "affinity"), 4) == 4.0
    knobs = routing.RoutingKnobs(balance_abs=8, balance_rel=1.2)
    nodes = routing.route(reqs, 4, "cache-aware", knobs)
    assert _max_over_mean(nodes, 4) <= 1.25
    # Locality: every later turn of a conversation meets the node of its first turn
    # (it holds all but the new block of the request).
    first: dict[int, int] = {}
    moved = 0
    for r, n in zip(reqs, nodes, strict=True):
        conv = r.hash_ids[2]
        moved += first.setdefault(conv, n) != n
    assert moved <= len(reqs) // 20
    # Imbalance overrides the match: with a zero threshold every request goes to
    # the least-loaded node, so the nodes take turns.
    strict = routing.RoutingKnobs(balance_abs=0, balance_rel=1.0)
    dealt = routing.route(reqs, 4, "cache-aware", strict)
    assert routing.balance(dealt, 4)["requests_per_node"] == [100] * 4


@needs_trace
def test_new_routings_balance_the_conversation_trace_hashed_on_its_shared_block() -> None:
    reqs = load(CONVERSATION, limit=2000)
    one = routing.RoutingKnobs(affinity_blocks=1)
    assert _max_over_mean(routing.route(reqs, 4, "affinity", one), 4) == 4.0
    assert _max_over_mean(routing.route(reqs, 4, "bounded", one), 4) <= 1.25 + 4 / 2000
    assert _max_over_mean(routing.route(reqs, 4, "cache-aware", one), 4) <= 1.25


def test_targets_compare_read_through_and_routing() -> None:
    def row(routing: str, rt: bool, gets: int, hit: float) -> dict[str, Any]:
        return {"remote": "redis", "capacity_percent": 10.0, "routing": routing,
                "read_through": rt, "remote_gets": {"objects": gets}, "block_hit_rate": hit,
                "remote_repeats": gets // 2}

    rows = [row("round-robin", False, 1000, 0.30), row("round-robin", True, 600, 0.30),
            row("affinity", False, 800, 0.31), row("affinity", True, 500, 0.31)]
    (t,) = fleet.targets(rows)
    assert t["read_through_cut"] == pytest.approx(0.4) and t["met"]
    assert t["cut_bound"] == pytest.approx(0.5)  # 500 of the 1,000 GETs off were repeats
    assert t["affinity_cut"] == pytest.approx(0.2) and t["remote_gets_affinity_on"] == 500
    assert t["routing_share_of_gain"] == pytest.approx(0.5)  # 200 of the 400 GETs saved
    rows[1]["block_hit_rate"] = 0.29
    assert not fleet.targets(rows)[0]["met"]


# -- a real fleet ---------------------------------------------------------------------------
#: Two nodes, round-robin: even requests on node 0, odd ones on node 1; a primary of
#: 10 blocks, so the 10-block requests push the earlier blocks out of it.
TRACE = [
    _req(1, 2, 3, 4, 5, 6),  # 0: computed (fs 0, remote)
    _req(1, 2, 3, 4, 5, 6, 7),  # 1: 1-6 from the remote; 7 computed
    _req(*range(11, 21)),  # 0
    _req(*range(21, 31)),  # 1
    _req(1, 2, 3, 4, 5, 6, 8),  # 0: 1-6 from its fs
    _req(1, 2, 3, 4, 5, 6, 7, 9),  # 1: 1-6 from the remote again, 7 from its fs
    _req(31, 25),  # 0: 31 misses, so 25 is computed again: node 1 stored it
    _req(33, 34),  # 1
    _req(31),  # 0: from its primary
    _req(33),  # 1: from its primary
]


@pytest.fixture(scope="module")
def fleet_result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM")
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed")
    moto_server_bin()
    # Round-robin only (affinity deals by fleet.route, tested above): each run costs
    # seconds, the node processes tens of seconds.
    plan = fleet.FleetPlan(trace=Path("hand-made"), nodes=2, capacities=(100.0,),
                           routings=("round-robin",), chunk_kib=8, primary_blocks=10,
                           directory=tmp_path_factory.mktemp("fleet"))
    return fleet.run(plan, TRACE, progress=lambda msg: None)


def test_the_fleet_runs_every_remote_and_read_through(fleet_result: dict[str, Any]) -> None:
    runs = [(r["remote"], r["routing"], r["read_through"]) for r in fleet_result["rows"]]
    assert runs == [(remote, "round-robin", rt) for remote in ("redis", "s3")
                    for rt in (False, True)]
    assert fleet_result["distinct_blocks"] == 32


def test_per_source_hits_and_per_node_figures_add_up(fleet_result: dict[str, Any]) -> None:
    for row in fleet_result["rows"]:
        nodes = row["per_node"]
        assert sum(row["hits"].values()) == row["blocks_hit"]
        for n in nodes:
            assert sum(n["hits"].values()) == n["blocks_hit"]
            # Every block promoted from a tier was a hit counted for it, but for
            # one: vLLM scans past a RETRY to start the next lookups, so block 25
            # behind node 0's miss of 31 is promoted when 31's check is the slower.
            assert 0 <= n["remote_gets"]["objects"] - n["hits"]["remote"] <= _raced(row)
            assert n["hits"]["fs"] == n["counters"]["fs"]["objects_loaded"]
        for key in ("requests", "blocks_requested", "blocks_hit", "remote_put_attempts",
                    "remote_existed", "read_through_stored"):
            assert row[key] == sum(n[key] for n in nodes), key
        for key in ("remote_gets", "remote_puts"):
            for part in ("objects", "bytes"):
                assert row[key][part] == sum(n[key][part] for n in nodes)
        assert row["requests"] == len(TRACE)
        assert row["block_hit_rate"] == row["blocks_hit"] / row["blocks_requested"]
        # Write-once remote: each block written by one node; a later put of it "existed".
        assert row["remote_objects_on_server"] == row["remote_puts"]["objects"]
        assert row["remote_blocks"] == row["remote_objects_on_server"]
        assert row["remote_put_attempts"] == row["remote_puts"]["objects"] + row[
            "remote_existed"]
        assert row["remote_puts"]["bytes"] > row["remote_puts"]["objects"] * 8192 / 2


def _raced(row: dict[str, Any]) -> int:
    """1 if node 0 promoted block 25 behind its miss of 31 (a GET without a hit)."""
    n0 = row["per_node"][0]
    return n0["remote_gets"]["objects"] - n0["hits"]["remote"]


def test_round_robin_counts_each_source_and_the_duplicate(fleet_result: dict[str, Any]
                                                           ) -> None:
    for row in fleet_result["rows"]:
        n0, n1 = row["per_node"]
        assert (n0["requests"], n1["requests"]) == (5, 5)
        assert n0["hits"] == {"primary": 1, "fs": 6, "remote": 0}
        # Blocks 1-6, read from the remote by node 1's request 1, are read again by its
        # request 5: from the remote again, or with read-through from its own fs tier.
        if row["read_through"]:
            assert n1["hits"] == {"primary": 1, "fs": 7, "remote": 6}
            assert (n0["read_through_stored"], n1["read_through_stored"]) == (_raced(row), 6)
            assert row["remote_repeats"] == 0
        else:
            assert n1["hits"] == {"primary": 1, "fs": 1, "remote": 12}
            assert row["read_through_stored"] == 0
            assert (n0["remote_repeats"], n1["remote_repeats"]) == (0, 6)
        assert n1["fs_written"] == 14 + n1["read_through_stored"]
        # Block 25: stored by node 1, computed again by node 0, whose put found it
        # there; unless node 0's lookup promoted it (then it is in its primary).
        raced = _raced(row)
        assert raced in (0, 1)
        assert row["duplicate_blocks"] == 1 - raced
        assert (n0["remote_existed"], n1["remote_existed"]) == (1 - raced, 0)
        assert row["remote_puts"]["objects"] == 32
    # Read-through halves the remote GETs here, at the same hit rate: all it could
    # (half of the GETs without it repeat a node's earlier GET).
    raced = {(r["remote"], r["read_through"]): _raced(r) for r in fleet_result["rows"]}
    assert [(t["remote"], t["remote_gets_off"] - raced[t["remote"], False],
             t["remote_gets_on"] - raced[t["remote"], True], t["met"])
            for t in fleet_result["targets"]] == [("redis", 12, 6, True), ("s3", 12, 6, True)]
    assert all(t["cut_bound"] == 6 / t["remote_gets_off"] for t in fleet_result["targets"])


def test_the_tables_show_every_run(fleet_result: dict[str, Any]) -> None:
    from rich.console import Console

    from kvstore_tiers.tools.bench.tables import fleet_tables

    tables = fleet_tables(fleet_result)
    runs, per_node = tables[:2]
    assert (runs.row_count, per_node.row_count) == (4, 8)
    assert len(tables) == 4 and tables[2].row_count == 2
    assert tables[3].row_count == 4  # the routing table: one row per run
    console = Console(record=True, width=300)
    for table in tables:
        console.print(table)
    assert "round-robin" in console.export_text()


# -- the CLI ---------------------------------------------------------------------------------
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")
def test_cli_fleet_options_are_checked() -> None:
    from click.testing import CliRunner

    from kvstore_tiers.cli import main

    def usage(*args: str) -> str:
        r = CliRunner().invoke(main, ["bench", *args])
        assert r.exit_code == 2, r.output
        return r.output

    assert "only apply to --trace" in usage("--nodes", "4")
    trace = ["--trace", __file__]
    assert "--routing only apply to --nodes" in usage(*trace, "--routing", "affinity")
    assert "--policy do not apply to --nodes" in usage(*trace, "--nodes", "4", "--policy",
                                                       "reuse")
    assert "picks the shared remote" in usage(*trace, "--nodes", "4", "--tier", "fs")
    assert "--nodes" in usage(*trace, "--nodes", "9")
    # The options pass; the file is no trace.
    assert "not a trace request" in usage(*trace, "--nodes", "2", "--tier", "redis",
                                          "--read-through", "off")
