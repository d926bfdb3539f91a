"""``bench --trace``: the trace loader, the plain LRU reference, and the replay of the
real Mooncake trace through vLLM's real tiering manager with real fs and redis tiers."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from kvstore_tiers.errors import ConfigError
from kvstore_tiers.tools.bench import trace_reference
from kvstore_tiers.tools.bench.trace_file import TraceError, TraceRequest, distinct_blocks, load

#: The Mooncake traces: $KVSTORE_TRACES, else ``shared/data/traces`` beside the checkout.
TRACES = Path(os.environ.get("KVSTORE_TRACES") or
              Path(__file__).resolve().parents[2].parent / "shared/data/traces")
CONVERSATION = TRACES / "mooncake-conversation.jsonl"
needs_trace = pytest.mark.skipif(not CONVERSATION.exists(),
                                 reason=f"the Mooncake trace is not at {CONVERSATION}")


def _req(ids: list[int], tokens: int | None = None) -> TraceRequest:
    return TraceRequest(0, tokens if tokens is not None else 512 * len(ids), 0, tuple(ids))


# A hand-made trace whose LRU replay is worked out in the comments of the tests below.
TINY = [_req([1, 2, 3]), _req([1, 2, 4]), _req([1, 5], 600), _req([1, 2, 3])]


# -- the loader ----------------------------------------------------------------------------
@needs_trace
def test_loader_reads_the_real_trace_lines() -> None:
    reqs = load(CONVERSATION, limit=5)
    assert len(reqs) == 5
    first = reqs[0]
    # {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, ..., 13]}
    assert (first.timestamp_ms, first.input_length, first.output_length) == (0, 6758, 500)
    assert first.hash_ids == tuple(range(14))
    assert first.block_tokens(0) == 512
    assert first.block_tokens(13) == 6758 - 13 * 512
    assert sum(first.block_tokens(i) for i in range(14)) == 6758
    assert reqs[1].hash_ids[0] == 0  # every conversation shares block 0 (the system prompt)


@needs_trace
def test_real_trace_has_the_chain_property() -> None:
    """A block id always follows the same parent: its id implies its whole prefix."""
    reqs = load(CONVERSATION)
    assert len(reqs) == 12031
    assert distinct_blocks(reqs) == 182790  # the README's working set
    parent: dict[int, int | None] = {}
    for r in reqs:
        for i, h in enumerate(r.hash_ids):
            p = r.hash_ids[i - 1] if i else None
            assert parent.setdefault(h, p) == p, f"block {h} follows {p} and {parent[h]}"


def test_loader_names_a_bad_line(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text('{"timestamp": 1, "input_length": 600, "hash_ids": [4, 5]}\n'
                 '{"timestamp": 2, "input_length": 600}\n')
    with pytest.raises(TraceError, match=r"t.jsonl:2: not a trace request"):
        load(f)
    assert load(f, limit=1) == [TraceRequest(1, 600, 0, (4, 5))]
    f.write_text('{"input_length": 1100, "hash_ids": [4, 5]}\n')
    with pytest.raises(TraceError, match=r":1: 2 block ids cannot hold 1100"):
        load(f)


# -- the plain LRU reference -----------------------------------------------------------------
def test_reference_lru_writes_every_block_on_a_hand_made_trace() -> None:
    r = trace_reference.replay(TINY, capacity=3, policy="always")
    # A: 1 2 3 miss, written.  B: 1 2 hit, 4 written, 3 evicted.  C: 1 hit, 5 written,
    # 2 evicted.  D: 1 hit, 2 and 3 written, 4 and 5 evicted.
    assert (r.blocks_requested, r.blocks_hit, r.blocks_written, r.evictions) == (11, 4, 7, 4)
    assert r.tokens_requested == 3 * 1536 + 600
    assert r.tokens_hit == 1024 + 512 + 512


def test_reference_lru_writes_on_second_sight() -> None:
    r = trace_reference.replay(TINY, capacity=3, policy="reuse", min_sightings=2)
    # A: nothing written.  B: 1 and 2 written (second sight), 4 not.  C: 1 hit, 5 not.
    # D: 1 2 hit, 3 written (second sight).
    assert (r.blocks_hit, r.blocks_written, r.evictions) == (3, 3, 0)
    with pytest.raises(ValueError, match="adaptive"):
        trace_reference.replay(TINY, 3, "adaptive")


def test_design_replay_drives_the_policy_objects_as_a_tier_does() -> None:
    from kvstore_tiers.tools.bench import trace_design

    # reuse: the reference's second sight on this trace (its counts are exact here).
    r = trace_design.policy_replay(TINY, 3, "reuse")
    assert (r["block_hit_rate"], r["blocks_written"]) == (3 / 11, 3)
    # adaptive in a tier that never fills: writes everything, as the reference's always.
    ref = trace_reference.replay(TINY, 100, "always")
    r = trace_design.policy_replay(TINY, 100, "adaptive")
    assert (r["block_hit_rate"], r["blocks_written"]) == (ref.block_hit_rate, 5) == (6 / 11, 5)
    assert trace_design.policy_replay(TINY, 100, "always")["blocks_written"] == 5
    # A primary that holds everything serves every hit: the tier is written, never read.
    r = trace_design.policy_replay(TINY, 100, "always", primary=100)
    assert (r["block_hit_rate"], r["tier_block_hit_rate"], r["blocks_written"]) == (6 / 11, 0, 5)
    with pytest.raises(ValueError, match="sometimes"):
        trace_design.policy_replay(TINY, 3, "sometimes")


def test_design_replay_passes_adaptives_write_cost(monkeypatch) -> None:
    from kvstore_tiers.tools.bench import trace, trace_design

    def sampled(block_id: int) -> bytes:  # every key in adaptive's hash sample
        k = trace.block_key(block_id)
        return k[:-5] + b"\0" + k[-4:]

    # Each block read again at once, then two never seen again: once the
    # tier of 16 is full, writing everything gains a hit per two writes it adds.
    groups = [[_req([3 * i]), _req([3 * i]), _req([3 * i + 1]), _req([3 * i + 2])]
              for i in range(300)]
    reqs = [r for g in groups for r in g]

    def replay(cost: float) -> tuple[float, int]:
        r = trace_design.policy_replay(reqs, 16, "adaptive", key=sampled, write_cost=cost)
        return r["block_hit_rate"], r["blocks_written"]

    pays, costs = replay(0.2), replay(0.8)
    assert pays == (1 / 4, 900)  # every block written, each group's second request served
    assert costs[0] < 0.02 and costs[1] < 400  # gated: written at its second sighting

    passed = []
    replay_one = trace_design.policy_replay

    def spy(*args, **kwargs):
        passed.append(kwargs.get("write_cost"))
        return replay_one(*args, **kwargs)

    monkeypatch.setattr(trace_design, "policy_replay", spy)
    assert trace_design.run(TINY, [100.0], write_cost=0.5)["write_cost"] == 0.5
    assert len(passed) == 5 and set(passed) == {0.5}


def test_design_replay_evicts_in_rounds_between_watermarks() -> None:
    from kvstore_tiers.tools.bench import trace_design

    # Six new blocks, then the third again. A plain LRU of 4 still holds 3-6;
    # a tier with watermarks 1.0 / 0.5 has room for 5 (4 / 0.75, rounded),
    # and the sixth block sent it down to 2 (5 and 6).
    trace = [_req([i]) for i in range(1, 7)] + [_req([3])]
    plain = trace_design.policy_replay(trace, 4, "always")
    assert (plain["block_hit_rate"], plain["evictions"], plain["blocks_written"]) == (1 / 7, 2, 6)
    band = trace_design.policy_replay(trace, 4, "always", watermarks=(1.0, 0.5))
    assert (band["block_hit_rate"], band["evictions"], band["blocks_written"]) == (0.0, 4, 7)
    assert trace_design.run(TINY, [100.0], watermarks=(0.95, 0.5))["watermarks"] == (0.95, 0.5)


def test_the_replays_fs_watermarks_are_its_own_or_the_tier_keys() -> None:
    from kvstore_tiers.tools.bench import trace

    assert trace.fs_watermarks({}) == trace.FS_WATERMARKS
    assert trace.fs_watermarks({"low_watermark": 0.85}) == (0.95, 0.85)
    assert trace.fs_watermarks({"high_watermark": 0.9, "low_watermark": 0.97}) == (0.9, 0.9)
    # as the tier's config model takes them: True is 1.0 there too
    assert trace.fs_watermarks({"low_watermark": True}) == (0.95, 0.95)
    for bad in (0, 1.5, "high"):
        with pytest.raises(ConfigError, match="key 'low_watermark'"):
            trace.fs_watermarks({"low_watermark": bad})


def test_design_tool_takes_watermarks_and_write_cost_as_the_tier_does(monkeypatch, tmp_path,
                                                                      capsys) -> None:
    from kvstore_tiers.tools.bench import trace_design

    trace_path = tmp_path / "t.jsonl"
    trace_path.write_text("".join(json.dumps({"timestamp": i, "input_length": 512,
                                              "output_length": 1, "hash_ids": [i]}) + "\n"
                                  for i in range(4)))
    seen = []
    monkeypatch.setattr(trace_design, "run", lambda reqs, pcts, **kw: seen.append(kw) or
                        {"rows": [], "watermarks": kw["watermarks"]})
    monkeypatch.setattr(trace_design, "markdown", lambda result: "")
    trace_design.main([str(trace_path), "--watermarks", "0.9", "0.97", "--write-cost", "0.2"])
    assert seen[-1]["watermarks"] == (0.9, 0.9) and seen[-1]["write_cost"] == 0.2
    for argv, key in ((["--watermarks", "0.9", "0"], "low_watermark"),
                      (["--watermarks", "1.5", "0.5"], "high_watermark"),
                      (["--write-cost", "2"], "admission_write_cost")):
        with pytest.raises(SystemExit) as exc:
            trace_design.main([str(trace_path), *argv])
        assert exc.value.code == 2 and f"key '{key}'" in capsys.readouterr().err
    assert len(seen) == 1


def test_a_salt_hashes_the_same_trace_into_other_keys() -> None:
    from kvstore_tiers.tools.bench import trace_design
    from kvstore_tiers.tools.bench.trace import block_key

    assert trace_design.salted_key("") is block_key
    a, b = trace_design.salted_key("s1"), trace_design.salted_key("s2")
    assert a(7) == a(7)
    assert len({a(7), b(7), block_key(7)}) == 3
    assert len(a(7)) == len(block_key(7)) and a(7)[-4:] == block_key(7)[-4:]
    # The replay names its blocks with the key function it is given...
    named: list[int] = []
    trace_design.policy_replay(TINY, 3, "reuse", key=lambda h: named.append(h) or a(h))
    assert sorted(set(named)) == sorted({h for r in TINY for h in r.hash_ids})
    # ... and the same blocks under other names keep an exact policy's hits and writes.
    for salt in ("", "s1"):
        r = trace_design.policy_replay(TINY, 3, "reuse", key=trace_design.salted_key(salt))
        assert (r["block_hit_rate"], r["blocks_written"]) == (3 / 11, 3)
    assert trace_design.run(TINY, [100.0], salt="s1")["salt"] == "s1"


def test_design_replay_counts_where_first_sight_writes_pay() -> None:
    from kvstore_tiers.tools.bench import trace_design

    # Capacity 3, write everything: 1 2 3 4 5 are written at their first sighting;
    # 1 is read three times and 2 once before eviction; 3 4 5 never.
    fs = trace_design.first_sight_sources(TINY, 3)
    assert (fs["first_sight_writes"], fs["useful"], fs["hits_served"]) == (5, 2, 4)
    assert sum(b["writes"] for b in fs["distance_from_end"].values()) == 5
    # A first copy evicted unread is not useful, whatever later copies serve.
    fs = trace_design.first_sight_sources([_req([7]), _req([8]), _req([7]), _req([7])], 1)
    assert (fs["first_sight_writes"], fs["useful"], fs["hits_served"]) == (2, 0, 0)
    out = trace_design.run(TINY, percents=(60.0, 100.0))
    assert [row["capacity_blocks"] for row in out["rows"]] == [3, 5]
    assert "| 100 % | 0.545 / 5 |" in trace_design.markdown(out)


@needs_trace
@pytest.mark.parametrize(("percent", "policy", "hit", "written"), [
    (2, "always", 0.079, 265_797), (2, "reuse", 0.143, 64_355),
    (20, "always", 0.345, 189_097), (100, "reuse", 0.213, 44_144)])
def test_reference_gives_the_trace_readmes_figures(percent: float, policy: str, hit: float,
                                                   written: int) -> None:
    reqs = load(CONVERSATION)
    cap = trace_reference.capacity_blocks(distinct_blocks(reqs), percent)
    r = trace_reference.replay(reqs, cap, policy)
    assert round(r.block_hit_rate, 3) == hit
    assert r.blocks_written == written


# -- the replay through vLLM's manager ----------------------------------------------------------
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="needs vLLM")


def _plan(tmp_path: Path, **kw):
    from kvstore_tiers.tools.bench.trace import TracePlan

    return TracePlan(trace=CONVERSATION, directory=tmp_path, chunk_kib=16, **kw)


@needs_vllm
@needs_trace
def test_fs_replay_of_the_real_trace_agrees_with_the_reference(tmp_path: Path) -> None:
    from kvstore_tiers.tools.bench import trace

    # 200 requests: the first whose prefixes outlive the primary (the longest request
    # + 32 blocks), so some hits are the tier's.
    reqs = load(CONVERSATION, limit=200)
    distinct = distinct_blocks(reqs)
    result = trace.run(_plan(tmp_path, capacities=(100, 50)), reqs, progress=lambda m: None)
    full, small = result["rows"]
    assert full["capacity_percent"] == 100 and small["capacity_percent"] == 50
    for row in (full, small):
        rp, c = row["replay"], row["counters"]
        assert rp["requests"] == 200
        assert rp["blocks_requested"] == sum(len(r.hash_ids) for r in reqs)
        assert rp["tier_blocks_hit"] <= rp["blocks_hit"] <= rp["blocks_requested"]
        assert rp["tokens_hit"] <= rp["tokens_requested"]
        assert row["objects_written"] == c["objects_stored"]
        assert c["store_failures"] == c["stores_dropped"] == 0
        # Every block vLLM cascaded was written, or skipped as stored already.
        assert rp["blocks_cascaded"] == c["objects_stored"] + c["objects_skipped"]
        assert row["not_cascaded"] == 0
    # 100 %: nothing is evicted, so the real manager serves exactly what the plain
    # LRU serves, and writes each distinct block once.
    ref = full["reference"]
    assert full["evictions"] == 0 and full["stale_hits"] == 0
    assert full["replay"]["blocks_hit"] == ref["blocks_hit"]
    assert full["objects_written"] == ref["blocks_written"] == distinct
    assert full["replay"]["tier_blocks_hit"] > 0
    # 50 %: the fs evictor made room (and kept the replay's count: every block written).
    assert small["evictions"] > 0
    assert small["objects_written"] >= distinct
    assert small["replay"]["blocks_hit"] <= full["replay"]["blocks_hit"]


@needs_vllm
@needs_trace
def test_redis_replay_with_maxmemory_evicts(tmp_path: Path) -> None:
    pytest.importorskip("redis")
    import shutil

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed")
    from kvstore_tiers.tools.bench import trace

    reqs = load(CONVERSATION, limit=60)
    result = trace.run(_plan(tmp_path, tiers=("redis",), redis_capacities=(5, 100)), reqs,
                       progress=lambda m: None)
    small, full = result["rows"]
    assert full["evictions"] == 0
    assert full["replay"]["blocks_hit"] == full["reference"]["blocks_hit"]
    assert full["keys_at_end"] == full["objects_written"] == distinct_blocks(reqs)
    assert small["evictions"] > 0  # redis evicted_keys: maxmemory held
    assert small["keys_at_end"] < full["keys_at_end"]
    assert small["maxmemory"] < full["maxmemory"]
    # The server publishes its evictions and the tier follows them: its index
    # drops evicted blocks, where without the events they stay stale hits.
    reqs = load(CONVERSATION, limit=200)
    stale = {mode: trace.run(_plan(tmp_path, tiers=("redis",), redis_capacities=(5,),
                                   extra_tier_keys={"eviction_events": mode}), reqs,
                             progress=lambda m: None)["rows"][0]["stale_hits"]
             for mode in ("off", "auto")}
    assert stale["off"] > 20
    assert stale["auto"] < stale["off"] / 4


# -- the CLI ---------------------------------------------------------------------------------
@needs_vllm
def test_cli_trace_options_are_checked() -> None:
    from click.testing import CliRunner

    from kvstore_tiers.cli import main

    runner = CliRunner()
    r = runner.invoke(main, ["bench", "--policy", "reuse"])
    assert r.exit_code == 2 and "--policy only apply to --trace" in r.output
    r = runner.invoke(main, ["bench", "--trace", __file__, "--quick"])
    assert r.exit_code == 2 and "drop --quick" in r.output
    r = runner.invoke(main, ["bench", "--trace", __file__, "--capacity", "0"])
    assert r.exit_code == 2 and "--capacity" in r.output
    r = runner.invoke(main, ["bench", "--trace", __file__, "--policy", "lru"])
    assert r.exit_code == 2 and "--policy" in r.output
    r = runner.invoke(main, ["bench", "--trace", __file__, "--chunk-kib", "16",
                             "--chunk-kib", "32"])
    assert r.exit_code == 2 and "one --chunk-kib" in r.output
    r = runner.invoke(main, ["bench", "--trace", __file__])
    assert r.exit_code == 2 and "not a trace request" in r.output
    r = runner.invoke(main, ["bench", "--trace", __file__, "--tier-key", "eviction_events"])
    assert r.exit_code == 2 and "KEY=VALUE" in r.output
    r = runner.invoke(main, ["bench", "--trace", __file__, "--tier", "fs", "--tier-key",
                             "eviction_events=off"])
    assert r.exit_code == 2 and "fs has no config key 'eviction_events'" in r.output
    r = runner.invoke(main, ["bench", "--trace", __file__, "--tier-key", "admission=reuse"])
    assert r.exit_code == 2 and "the replay sets 'admission' itself" in r.output
    r = runner.invoke(main, ["bench", "--tier-key", "compression=none"])
    assert r.exit_code == 2 and "--tier-key only apply to --trace" in r.output


@needs_vllm
def test_cli_trace_run_writes_the_result(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from kvstore_tiers.cli import main

    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps({"timestamp": i, "input_length": 512 * len(ids),
                                     "output_length": 1, "hash_ids": ids}) + "\n"
                         for i, ids in enumerate([[1, 2, 3], [1, 2, 4], [1, 5], [1, 2, 3]])))
    r = CliRunner().invoke(main, ["bench", "--trace", str(f), "--requests", "3",
                                  "--capacity", "100", "--chunk-kib", "8", "--no-plots",
                                  "--tier-key", "compression=none", "--tier-key",
                                  "n_read_threads=3", "--tier-key", "low_watermark=0.85",
                                  "--dir", str(tmp_path / "d"), "--out", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    out = json.loads((tmp_path / "o/trace.json").read_text())["trace"]
    assert out["requests"] == 3 and out["distinct_blocks"] == 5
    (row,) = out["rows"]
    assert (row["tier"], row["policy"], row["capacity_percent"]) == ("fs", "always", 100)
    # A: 3 misses; B: 1 2 hit (from the primary or the tier), 4 written; C: 1 hit, 5 written.
    assert row["replay"]["blocks_hit"] == 3 and row["objects_written"] == 5
    assert out["chunk_bytes"] == 8192
    assert out["tier_keys"] == {"compression": "none", "n_read_threads": 3,
                                "low_watermark": 0.85}
    # The watermarks given size max_bytes: the middle of their band holds the capacity.
    assert row["watermarks"] == [0.95, 0.85]
    room = row["max_bytes"] - row["overhead_bytes"]
    assert room == int(5 * row["disk_bytes_per_object"] / ((0.95 + 0.85) / 2))


@needs_vllm
@needs_trace
def test_reuse_admission_is_counted_through_the_real_tier(tmp_path: Path) -> None:
    """With ``admission: reuse`` the tier declines first offers: every block vLLM
    cascaded is written, skipped as present, or counted as not admitted."""
    from kvstore_tiers.tools.bench import trace

    reqs = load(CONVERSATION, limit=200)
    result = trace.run(_plan(tmp_path, capacities=(100,), policies=("always", "reuse")), reqs,
                       progress=lambda m: None)
    always, reuse = result["rows"]
    assert reuse["policy"] == "reuse" and reuse["skipped_admission"] > 0
    assert always["skipped_admission"] == 0
    assert reuse["objects_written"] < always["objects_written"]
    c = reuse["counters"]
    assert reuse["replay"]["blocks_cascaded"] == (
        c["objects_stored"] + c["objects_skipped"] + reuse["skipped_admission"])
    assert reuse["not_cascaded"] == 0
    assert reuse["replay"]["tier_blocks_hit"] <= always["replay"]["tier_blocks_hit"]
