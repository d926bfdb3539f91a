"""Rich tables of a ``kvstore-tiers bench`` result: each number beside its baseline."""

from __future__ import annotations

from typing import Any

KiB, MiB = 1 << 10, 1 << 20


def _scheduler_table(sched: dict[str, Any], phase: str) -> Any:
    from rich.table import Table

    s = Table(title="scheduler-thread time, microseconds (our jobs: 16 chunks of 256 KiB; "
              f"calls, then per chunk moved; {phase})")
    for col in ("method", "ours p50", "vLLM p50", "ours p99", "vLLM p99",
                "ours p99/chunk", "vLLM p99/chunk", "no GC: ours p99", "vLLM p99",
                "ours p99/chunk", "vLLM p99/chunk", "GC in calls ours/vLLM",
                "GC allocs/call ours/vLLM"):
        s.add_column(col, justify="right")
    ours, stock = sched.get("kvstore", {}), sched.get("vllm", {})

    def cell(d: dict[str, Any], k: str) -> str:
        return f"{d[k]:.1f}" if k in d else "-"

    for m in ours:
        st = stock.get(m, {})
        s.add_row(m, *(cell(d, k) for k in ("p50_us", "p99_us", "p99_us_per_chunk",
                                             "p99_us_no_gc", "p99_us_per_chunk_no_gc")
                       for d in (ours[m], st)),
                  f"{ours[m].get('gc_calls', '-')}/{st.get('gc_calls', '-')}",
                  f"{cell(ours[m], 'net_gc_allocs')}/{cell(st, 'net_gc_allocs')}")
    return s



def _size(c: int) -> str:
    return f"{c // KiB} KiB" if c < MiB else f"{c // MiB} MiB"


def _reload_table(rows: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    t = Table(title="fs reload: load-only rounds rereading the same stored files "
              "(GB/s, median of rounds; x: geometric mean over AB/BA round pairs, "
              "approximate 95 % interval)")
    for col in ("chunk", "reqs", "rounds", "load ours", "load vLLM", "x", "95 % interval"):
        t.add_column(col, justify="right")
    for r in rows:
        low, high = r["load_ratio_ci95"]
        t.add_row(_size(r["chunk_bytes"]), str(r["requests"]), str(r["rounds"]),
                  f"{r['kvstore_load_gbps']:.2f}", f"{r['vllm_load_gbps']:.2f}",
                  f"{r['load_ratio']:.2f}", f"{low:.2f}-{high:.2f}")
    return t


def _reference_table(ref: dict[str, Any]) -> Any:
    from rich.table import Table

    t = Table(title=f"this machine, one thread, {_size(ref['bytes'])} of incompressible "
              f"bytes (GB/s, best of {ref['repeats']})")
    for col in ("reference", "GB/s"):
        t.add_column(col, justify="right")
    t.add_row("memcpy (numpy copyto)", f"{ref['memcpy_gbps']:.2f}")
    t.add_row("CRC-32C (crc32c package)", f"{ref['crc32c_gbps']:.2f}")
    return t


def _cpu(v: float | None) -> str:
    return f"{v:.2f}" if v is not None else "-"


def _cpu_table(rows: list[dict[str, Any]], ref: dict[str, Any] | None) -> Any:
    from rich.table import Table

    t = Table(title="fs: process CPU seconds (user + system, every thread) per GB moved, "
              "median of rounds, then the same less the driving thread (the bench's "
              "scheduler loop, polling every 0.2-1 ms, and the tiers' scheduler-side "
              "calls); load GB/s as a fraction of one thread's memcpy")
    for col in ("chunk", "reqs", "store CPU s/GB ours", "vLLM", "I/O threads: ours", "vLLM",
                "load CPU s/GB ours", "vLLM", "I/O threads: ours", "vLLM",
                "load/memcpy ours", "vLLM"):
        t.add_column(col, justify="right")
    memcpy = ref["memcpy_gbps"] if ref else None
    for r in rows:
        frac = [f"{r[f'{k}_load_gbps'] / memcpy:.0%}" if memcpy else "-"
                for k in ("kvstore", "vllm")]
        t.add_row(_size(r["chunk_bytes"]), str(r["requests"]),
                  *(_cpu(r.get(f"{k}_{op}{io}_cpu_s_per_gb")) for op in ("store", "load")
                    for io in ("", "_io") for k in ("kvstore", "vllm")), *frac)
    return t


def print_tables(result: dict[str, Any], console: Any = None) -> None:
    """Rich tables of everything in ``result``: each number beside its baseline."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    if result.get("reference"):
        console.print(_reference_table(result["reference"]))
    if result.get("engine"):
        for table in engine_tables(result["engine"]):
            console.print(table)
    fs = result.get("fs")
    if fs and fs["throughput"]:
        disk = "disk O_DIRECT" if fs.get("disk_o_direct", True) else "disk buffered (no O_DIRECT)"
        t = Table(title=f"fs: kvstore-tiers vs vLLM stock fs tier vs {disk} "
                  "(GB/s, median of rounds; x: ours/vLLM balanced over AB/BA round pairs; "
                  "same run)")
        for col in ("chunk", "reqs", "store ours", "store vLLM", "x", "disk write",
                    "store/disk", "load ours", "load vLLM", "x", "disk read", "load/disk",
                    "no-RETRY steps ours/vLLM", "steps to HIT ours/vLLM"):
            t.add_column(col, justify="right")
        for r in fs["throughput"]:
            d = fs["disk"].get(r["chunk_bytes"]) or fs["disk"].get(str(r["chunk_bytes"]))
            t.add_row(_size(r["chunk_bytes"]), str(r["requests"]),
                      f"{r['kvstore_store_gbps']:.2f}", f"{r['vllm_store_gbps']:.2f}",
                      f"{r['store_ratio']:.2f}", f"{d['write_gbps']:.2f}",
                      f"{r['store_vs_disk_write']:.0%}",
                      f"{r['kvstore_load_gbps']:.2f}", f"{r['vllm_load_gbps']:.2f}",
                      f"{r['load_ratio']:.2f}", f"{d['read_gbps']:.2f}",
                      f"{r['load_vs_disk_read']:.0%}",
                      f"{r.get('kvstore_lookup_steps', '?')}/{r.get('vllm_lookup_steps', '?')}",
                      f"{r.get('kvstore_steps_to_hit', '?')}/{r.get('vllm_steps_to_hit', '?')}")
        console.print(t)
        console.print(_cpu_table(fs["throughput"], result.get("reference")))
    if fs:
        if fs.get("reload"):
            console.print(_reload_table(fs["reload"]))
        for section, phase in (("scheduler", "the waves fix the GC's phase"),
                               ("scheduler_gc_random_phase", "GC phase random per wave")):
            if fs.get(section):
                console.print(_scheduler_table(fs[section], phase))
        ours, stock = fs["scheduler"].get("kvstore", {}), fs["scheduler"].get("vllm", {})
        floor = [d.get("get_finished_jobs", {}).get("p99_us_empty_polls", 0.0)
                 for d in (ours, stock)]
        console.print("no GC: calls in which Python's cyclic GC ran (it collects the whole "
                      "process and starts in whichever thread allocates past its threshold) "
                      "left out. Noise floor, p99 of get_finished_jobs calls that reported "
                      f"nothing (sub-microsecond work): ours {floor[0]:.1f} us, "
                      f"vLLM {floor[1]:.1f} us")
        if fs.get("compression"):
            c = Table(title="codecs on real bf16 KV (our fs tier; effective = raw KV GB/s)")
            for col in ("sample", "block", "codec", "ratio", "store eff. GB/s",
                        "load eff. GB/s"):
                c.add_column(col, justify="right")
            for r in fs["compression"]:
                c.add_row(r["file"], _size(r["block_bytes"]), r["codec"], f"{r['ratio']:.3f}",
                          f"{r['store_effective_gbps']:.2f}", f"{r['load_effective_gbps']:.2f}")
            console.print(c)
    if "redis" in result:
        console.print(_redis_table(result["redis"]["bandwidth"]))
        if result["redis"].get("memory"):
            console.print(_redis_memory_table(result["redis"]["memory"]))
    if "s3" in result:
        for table in _s3_tables(result["s3"]):
            console.print(table)


def _redis_table(b: dict[str, Any]) -> Any:
    from rich.table import Table

    own = "redis_benchmark_keys_set_MiBps" in b
    base, col = (("redis_benchmark_keys", "redis-benchmark (distinct keys)") if own
                 else ("raw_client", "redis-py pipelined loop"))
    suffix = "_keys" if own else "_raw"
    t = Table(title=f"redis on {b.get('server', 'a local redis-server')}: tier vs {col} "
              f"({b['block_bytes'] // KiB} KiB values, MiB/s, median of rounds; "
              "x: balanced over AB/BA round pairs; CPU: this process's s per GB)")
    for name in ("op", "tier", col, "x", "CPU s/GB tier", "CPU s/GB baseline"):
        t.add_column(name, justify="right")
    for op in ("set", "get"):
        t.add_row(op.upper(), f"{b[f'tier_{op}_MiBps']:.0f}", f"{b[f'{base}_{op}_MiBps']:.0f}",
                  f"{b[f'{op}_ratio{suffix}']:.2f}", _cpu(b.get(f"tier_{op}_cpu_s_per_gb")),
                  _cpu(b.get(f"raw_client_{op}_cpu_s_per_gb")))
    if "tier_get_transfer_MiBps" in b:
        t.add_row("GET, transfer only", f"{b['tier_get_transfer_MiBps']:.0f}",
                  f"{b[f'{base}_get_MiBps']:.0f}", f"{b[f'get_transfer_ratio{suffix}']:.2f}",
                  _cpu(b.get("tier_get_transfer_cpu_s_per_gb")),
                  _cpu(b.get("raw_client_get_cpu_s_per_gb")))
    return t


def _redis_memory_table(rows: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    t = Table(title="redis memory per block, real KV samples (bytes: MEMORY USAGE per key)")
    for col in ("sample", "raw block", "none", "kvsplit", "none/kvsplit"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(r["file"], str(r["block_bytes"]), f"{r['none_memory_usage_per_block']:.0f}",
                  f"{r['kvsplit_memory_usage_per_block']:.0f}", f"{r['ratio']:.2f}")
    return t


def _s3_tables(s3: dict[str, Any]) -> list[Any]:
    from rich.table import Table

    g = s3["gbps"]
    t = Table(title=f"s3 on {s3['server']}: tier vs raw aiobotocore (GB/s, "
              f"{s3['blocks']} blocks of {_size(s3['block_bytes'])}, concurrency "
              f"{s3['concurrency']}, median of {s3['rounds']} rounds)")
    for col in ("op", "tier", "raw aiobotocore", "tier / raw", "boto3 threads",
                "CPU s/GB tier", "CPU s/GB raw"):
        t.add_column(col, justify="right")
    c = s3.get("cpu_s_per_gb", {})
    t.add_row("store/PUT", f"{g['tier_store']:.3f}", f"{g['aio_put']:.3f}",
              f"{g['tier_store'] / g['aio_put']:.2f}", f"{g['threads_put']:.3f}",
              _cpu(c.get("tier_store")), _cpu(c.get("aio_put")))
    t.add_row("load/GET", f"{g['tier_load']:.3f}", f"{g['aio_get']:.3f}",
              f"{g['tier_load'] / g['aio_get']:.2f}", f"{g['threads_get']:.3f}",
              _cpu(c.get("tier_load")), _cpu(c.get("aio_get")))
    t.add_row("load/GET, transfer only", f"{g['tier_load_transfer']:.3f}", f"{g['aio_get']:.3f}",
              f"{g['tier_load_transfer'] / g['aio_get']:.2f}", "",
              _cpu(c.get("tier_load_transfer")), _cpu(c.get("aio_get")))
    out = [t]
    lk = s3.get("lookup")
    extra = Table(title="s3 lookup cost and bytes per block (real KV samples)")
    for col in ("what", "value"):
        extra.add_column(col, justify="right")
    if lk:
        extra.add_row("existence requests (GET or HEAD) per looked-up block, another engine",
                      f"{lk['other_engine_requests_per_block']:.2f}")
        extra.add_row("requests per looked-up block, the storing engine",
                      f"{lk['same_engine_requests_per_block']:.2f}")
    for f, b in s3.get("bytes_per_block", {}).items():
        extra.add_row(f"{f}: raw / none / kvsplit bytes (ratio)",
                      f"{b['raw']:.0f} / {b['none']:.0f} / {b['kvsplit']:.0f} "
                      f"({b['ratio']:.3f}x)")
    if extra.row_count:
        out.append(extra)
    return out


def _ratio_cell(r: dict[str, Any]) -> str:
    low, high = r["ci95"]
    if low != low:  # nan: fewer than two pairs
        return f"{r['ratio']:.2f}x"
    return f"{r['ratio']:.2f}x ({low:.2f}-{high:.2f})"


def engine_tables(engine: dict[str, Any]) -> list[Any]:
    """``bench --engine``: TTFT per arm with the paired ratios, each pair's runs, failures."""
    from rich.table import Table

    s = engine["summary"]
    plan = engine["plan"]
    ms = s["ttft_ms"]
    t = Table(title=f"time to first token in vLLM engines ({plan['model']}, "
              f"{plan['plan']['num_prompts']} prompts, {s['valid_pairs']} of {s['pairs']} pairs "
              "valid): ms, median over pairs; x: geometric mean over pairs, 95 % t interval",
              caption="cold: phase 1 stores the prompts' KV (empty tier); warm: phase 2, a new "
              "engine process, answers them from the tier; recompute: a new engine process "
              "without a tier. mean: over the prompts; first: prompt 1, whose whole prefix "
              "comes from the tier.")
    for col in ("tier", "cold mean", "cold first", "warm mean", "warm first",
                "recompute / warm, mean", "recompute / warm, first", "cold / warm, mean"):
        t.add_column(col, justify="right")
    for arm, label in (("ours", "ours (fs)"), ("stock", "vLLM stock (vllm_fs)"),
                       ("recompute", "no tier (recompute)")):
        m = ms[arm]
        tier = arm != "recompute"
        t.add_row(label,
                  f"{m['cold_mean']:.0f}" if tier else "-",
                  f"{m['cold_first']:.0f}" if tier else "-",
                  f"{m['warm_mean']:.0f}", f"{m['warm_first']:.0f}",
                  _ratio_cell(s["speedup_vs_recompute"][arm]["mean"]) if tier else "-",
                  _ratio_cell(s["speedup_vs_recompute"][arm]["first"]) if tier else "-",
                  _ratio_cell(s["cold_over_warm"][arm]["mean"]) if tier else "-")
    h = Table(title="warm TTFT, vLLM's stock fs tier / ours (paired; > 1: ours faster)")
    for col in ("prompts", "stock / ours", "95 % interval", "per pair"):
        h.add_column(col, justify="right")
    for key, label in (("mean", "all (mean TTFT)"), ("first", "first (the long one)")):
        r = s["stock_over_ours"][key]
        low, high = r["ci95"]
        h.add_row(label, f"{r['ratio']:.2f}x",
                  "-" if low != low else f"{low:.2f}-{high:.2f}",
                  " ".join(f"{x:.2f}" for x in r["pairs"]))
    split_tables: list[Any] = []
    split = s.get("warm_split")
    if split:
        w = Table(title="warm first prompt, where the time goes (ms, median over pairs): "
                  "waiting for the tier (lookups, load into the CPU primary), then the "
                  "forward pass")
        for col in ("tier", "wait for the tier", "forward pass to the first token"):
            w.add_column(col, justify="right")
        for arm, label in (("ours", "ours (fs)"), ("stock", "vLLM stock (vllm_fs)")):
            m = split["ms"][arm]
            w.add_row(label, f"{m['wait_first']:.0f}", f"{m['prefill_first']:.0f}")
        w.add_row("stock / ours", _ratio_cell(split["stock_over_ours_wait"]), "-")
        split_tables.append(w)
    p = Table(title="runs: warm TTFT ms, mean over prompts / first prompt")
    for col in ("pair", "order", "ours", "stock", "recompute", "tokens from tier ours/stock"):
        p.add_column(col, justify="right")
    by_pair: dict[int, dict[str, dict[str, Any]]] = {}
    for run in engine["runs"]:
        by_pair.setdefault(run["pair"], {})[run["arm"]] = run

    def cell(run: dict[str, Any] | None) -> str:
        if run is None or run.get("error") or not run.get("warm"):
            return "failed"
        ttft = run["warm"]["ttft_s"]
        return f"{1000 * sum(ttft) / len(ttft):.0f} / {1000 * ttft[0]:.0f}"

    for pair, runs in sorted(by_pair.items()):
        order = ", ".join(r["arm"] for r in sorted(runs.values(), key=lambda r: r["position"]))
        hits = "/".join(str(sum(runs[a]["warm"]["external_hit_tokens"]))
                        if runs.get(a, {}).get("warm") else "-" for a in ("ours", "stock"))
        p.add_row(str(pair + 1), order, cell(runs.get("ours")), cell(runs.get("stock")),
                  cell(runs.get("recompute")), hits)
    out = [t, h, *split_tables, p]
    if s["failed"]:
        f = Table(title="FAILED runs (left out of every figure with their pair)")
        for col in ("pair", "tier", "why"):
            f.add_column(col)
        for item in s["failed"]:
            f.add_row(str(item["pair"] + 1), item["arm"], "; ".join(item["reasons"]))
        out.append(f)
    return out


def trace_table(trace: dict[str, Any]) -> Any:
    """One row per (tier, policy, capacity) of a ``bench --trace`` result, the plain
    LRU reference beside the real-manager numbers."""
    from rich.table import Table

    t = Table(title=f"write economics: {trace['requests']:,} requests of {trace['trace']} "
              f"({trace['distinct_blocks']:,} distinct blocks), chunk "
              f"{_size(trace['chunk_bytes'])}, primary {trace['primary_blocks']} blocks; "
              "hit rates in blocks/blocks, 'tokens' in tokens/tokens")
    for col in ("tier", "policy", "cap %", "hit", "ref hit", "tier hit", "tier tokens",
                "objects written", "ref written", "bytes/token served", "evictions",
                "stale hits", "skipped (admission)", "not cascaded", "load GB/s", "s"):
        t.add_column(col, justify="right")
    for r in trace["rows"]:
        ref = r.get("reference") or {}
        bpt = r["bytes_written_per_token_served"]
        t.add_row(r["tier"], r["policy"], f"{r['capacity_percent']:g}",
                  f"{r['block_hit_rate']:.3f}",
                  f"{ref['block_hit_rate']:.3f}" if ref else "-",
                  f"{r['tier_block_hit_rate']:.3f}", f"{r['tier_token_hit_rate']:.3f}",
                  f"{r['objects_written']:,}",
                  f"{ref['blocks_written']:,}" if ref else "-",
                  f"{bpt:,.0f}" if bpt is not None else "-", f"{r['evictions']:,}",
                  f"{r['stale_hits']:,}", f"{r['skipped_admission']:,}",
                  f"{r['not_cascaded']:,}",
                  f"{r['load_gbps']:.3f}" if r["load_gbps"] is not None else "-",
                  f"{r['replay']['seconds']:.0f}")
    return t


def fleet_tables(fleet: dict[str, Any]) -> list[Any]:
    """A ``bench --trace --nodes`` result: one row per (remote, routing, read-through,
    capacity), one per node of each, and the read-through target per remote (when
    round-robin ran with read-through off and on)."""
    from rich.table import Column, Table

    def table(title: str, cols: str) -> Any:
        return Table(*(Column(c, justify="right") for c in cols.split(",")), title=title)

    head = (f"{fleet['nodes']} nodes, {fleet['requests']:,} requests of {fleet['trace']} "
            f"({fleet['distinct_blocks']:,} distinct blocks), chunk {_size(fleet['chunk_bytes'])},"
            f" primary {fleet['primary_blocks']} blocks per node")
    t = table(f"fleet: {head}; hit rates in blocks/blocks",
              "remote,routing,read-through,fs cap %,max/mean load,hit,primary,fs,remote,"
              "remote GETs,GET MiB,"
              "repeat GETs,PUTs,PUT MiB,PUT attempts,existed,dup blocks,RT stored,RT dropped,"
              "stale hits,s")
    n = table(f"fleet per node: {head}; hits in blocks",
              "remote,routing,read-through,node,requests,hit,primary,fs,remote,remote GETs,"
              "PUTs,PUT attempts,existed,RT stored,fs evictions")
    for r in fleet["rows"]:
        key = (r["remote"], r["routing"], "on" if r["read_through"] else "off")
        by = r["hit_rate_by_source"]
        t.add_row(*key, f"{r['capacity_percent']:g}", _opt(r.get("max_over_mean"), ".2f"),
                  f"{r['block_hit_rate']:.3f}",
                  *(f"{by.get(s, 0):.3f}" for s in ("primary", "fs", "remote")),
                  f"{r['remote_gets']['objects']:,}", f"{r['remote_gets']['bytes'] / MiB:,.1f}",
                  f"{r['remote_repeats']:,}", f"{r['remote_puts']['objects']:,}",
                  f"{r['remote_puts']['bytes'] / MiB:,.1f}",
                  *(f"{r[k]:,}" for k in ("remote_put_attempts", "remote_existed",
                                          "duplicate_blocks", "read_through_stored",
                                          "read_through_dropped", "stale_hits")),
                  f"{r['seconds']:.0f}")
        for p in r["per_node"]:
            n.add_row(*key, str(p["node"]), f"{p['requests']:,}",
                      f"{p['blocks_hit'] / max(1, p['blocks_requested']):.3f}",
                      *(f"{p['hits'].get(s, 0):,}" for s in ("primary", "fs", "remote")),
                      *(f"{p[k]['objects']:,}" for k in ("remote_gets", "remote_puts")),
                      *(f"{p[k]:,}" for k in ("remote_put_attempts", "remote_existed",
                                              "read_through_stored", "fs_evictions")))
    g = table("remote GETs: round-robin with read-through off and on (target: at least 30 % "
              "fewer at a hit rate no lower; at most: the share of GETs off that repeat a "
              "node's earlier GET); affinity routing off, its cut, as a multiple of "
              "read-through's, and on", "remote,fs cap %,GETs off,GETs on,cut,at most,hit off,"
              "hit on,met,affinity off,affinity cut,x read-through's,affinity on")
    for x in fleet.get("targets", []):
        g.add_row(x["remote"], f"{x['capacity_percent']:g}", f"{x['remote_gets_off']:,}",
                  f"{x['remote_gets_on']:,}", _opt(x["read_through_cut"], ".0%"),
                  _opt(x.get("cut_bound"), ".0%"),
                  f"{x['hit_rate_off']:.3f}", f"{x['hit_rate_on']:.3f}",
                  "yes" if x["met"] else "no", _opt(x.get("remote_gets_affinity_off"), ","),
                  _opt(x.get("affinity_cut"), ".0%"), _opt(x.get("routing_share_of_gain"), ".1f"),
                  _opt(x.get("remote_gets_affinity_on"), ","))
    rt = table("routing: load (requests per node, busiest / mean) beside remote GETs; cut "
               "against round-robin, and as a share of prefix affinity's cut",
               "remote,fs cap %,read-through,routing,requests per node,max/mean,remote GETs,"
               "hit,cut,of affinity's")
    for x in fleet.get("routing", []):
        rt.add_row(x["remote"], f"{x['capacity_percent']:g}", "on" if x["read_through"] else "off",
                   x["routing"], " / ".join(f"{c:,}" for c in x["requests_per_node"]),
                   f"{x['max_over_mean']:.2f}", f"{x['remote_gets']:,}",
                   f"{x['block_hit_rate']:.3f}", _opt(x["cut_vs_round_robin"], ".0%"),
                   _opt(x["of_affinity_cut"], ".2f"))
    return [t, n, *([g] if g.row_count else []), *([rt] if rt.row_count else [])]


def _opt(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def cost_table(costs: list[tuple[str, dict[str, Any]]]) -> Any:
    """``--cost``: per priced run, the requests per block stored and per block served
    by kind, their USD, and USD per million prompt tokens."""
    from rich.table import Column, Table

    from kvstore_tiers.tools.bench.cost import KINDS

    shown = [k for k in KINDS if any(c["requests"][k] for _, c in costs)] or ["PUT"]
    t = Table(*(Column(c, justify="right") for c in (
        "run", *(f"{k}s" for k in shown), *(f"{k} / block stored" for k in shown),
        *(f"{k} / block served" for k in shown), "requests $", "$ / M prompt tokens",
        "$ / M tokens served", "storage $ / month")),
        title=f"s3 requests and what they cost ({costs[0][1]['prices']['source']})")
    for label, c in costs:
        t.add_row(label, *(f"{c['requests'][k]:,}" for k in shown),
                  *(_opt(c["per_block_stored"][k], ".3f") for k in shown),
                  *(_opt(c["per_block_served"][k], ".3f") for k in shown),
                  f"{c['dollars']['total']:.4f}",
                  _opt(c["dollars_per_million_prompt_tokens"], ".4f"),
                  _opt(c["dollars_per_million_tokens_served"], ".4f"),
                  f"{c['storage_dollars_per_month']['measured']:.6f}")
    return t
