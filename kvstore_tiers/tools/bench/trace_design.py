"""A block-level replay of a trace through the admission policies themselves.

``python -m kvstore_tiers.tools.bench.trace_design TRACE [--requests N] [--json F]``
(``--help`` for the rest)

The replay of :mod:`.trace_reference` (one LRU cache of C blocks, prefix
semantics, nothing in flight), with each computed block's admission decided
by the policy objects of :mod:`kvstore_tiers.admission` as a tier calls
them: per request, its hit blocks are a load (``seen``) and its computed
blocks not already cached are one store job (``admit``). ``reuse`` and
``adaptive`` run at the tier's default sketch width; ``adaptive`` reads the
cache's fill as its capacity signal and runs its probe's update after every
request, its clock one :data:`~kvstore_tiers.admission.PROBE_INTERVAL_S` (a
tier's probe interval) later each time.
Beside them, from the same run: the exact reference policies (``always``,
``second sight``: write on the trace's second naming of a block). Then the
same three policies behind a primary tier (an LRU of the longest request
plus 32 blocks, as ``bench --trace`` sizes vLLM's CPU tier): the tier sees
only the loads and cascades the primary lets through, so the sightings its
policy counts are a real tier's, not the whole trace's.

It answers what the real-manager replay (``kvstore-tiers bench --trace``)
cannot at the trace's full length in minutes: how each policy's hit rate and
writes vary with the capacity, on every block of the trace. And, per
capacity, where write-everything's extra hits come from: the blocks it wrote
at their first sighting that were read before eviction ("useful"), by the
features an admission rule could see when the block is offered (its
distance from the end of its request, the request's prefix hits). The share
of useful first-sight writes in each bucket bounds what a rule on that
feature can keep.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvstore_tiers.admission import (
    PROBE_INTERVAL_S,
    AdaptivePolicy,
    CapacitySignal,
    ReusePolicy,
)
from kvstore_tiers.config import WRITE_COST, TierConfig, validate_config
from kvstore_tiers.sketch import FrequencySketch
from kvstore_tiers.tools.bench import trace_reference
from kvstore_tiers.tools.bench.trace import block_key, fs_watermarks
from kvstore_tiers.tools.bench.trace_file import TraceRequest, distinct_blocks, load

PERCENTS = (2.0, 5.0, 10.0, 20.0, 50.0, 100.0)

#: Buckets of a feature's value: (label, lowest value in it).
_AFTER = (("last block", 0), ("1-3 before the end", 1), ("4-15", 4), ("16+", 16))
_PREFIX = (("no prefix hit", 0), ("1-3 prefix hits", 1), ("4+", 4))


def _bucket(value: int, buckets: Sequence[tuple[str, int]]) -> str:
    label = buckets[0][0]
    for name, lowest in buckets:
        if value >= lowest:
            label = name
    return label


class _OneBlockFrames:
    """The write counters a CapacitySignal reads: one byte per block, so blocks = bytes."""

    objects_stored = 1
    stored_bytes_written = 1


def salted_key(salt: str) -> Callable[[int], bytes]:
    """Block ids to keys as :func:`~.trace.block_key`, or hashed under ``salt``:
    the same trace under another hash, so another sample of the keys for
    ``adaptive``'s miniatures (which sample by hash)."""
    if not salt:
        return block_key
    prefix, group = b"trace-block:" + salt.encode() + b":", block_key(0)[-4:]
    return lambda h: hashlib.sha256(prefix + b"%d" % h).digest() + group


def primary_blocks(requests: Sequence[TraceRequest]) -> int:
    """The primary's size: the longest request plus 32 blocks, as ``bench --trace`` has it."""
    return max(len(r.hash_ids) for r in requests) + 32


def policy_replay(requests: Sequence[TraceRequest], capacity: int, policy: str,
                  min_sightings: int = 2, primary: int = 0,
                  key: Callable[[int], bytes] = block_key,
                  watermarks: tuple[float, float] | None = None,
                  write_cost: float = WRITE_COST) -> dict[str, Any]:
    """Replay ``requests`` through an LRU tier of ``capacity`` blocks, admission by
    ``policy`` (``always``, or ``reuse``/``adaptive``: the tier's objects at its
    default sketch width).

    With ``primary`` > 0, an LRU primary of that many blocks stands in front,
    as vLLM's CPU tier does: a block it holds is served without the tier
    seeing it; a block promoted from the tier (a load: a sighting) or
    computed enters it; a computed block is cascaded to the tier (an offer).
    The tier then sees only what the primary lets through, as a real one does.

    With ``watermarks`` (high, low) the tier evicts as an fs evictor does: in
    rounds, once it holds more than ``high`` of its room, down to ``low`` of
    it, the room sized so that the band's middle is ``capacity`` blocks (as
    ``bench --trace`` sizes ``max_bytes``); ``adaptive`` reads the room as
    its capacity.

    ``write_cost``: ``adaptive``'s, in hits per write (the tier's default unless given).
    """
    room, high, low = capacity, capacity, capacity
    if watermarks is not None:
        room = max(1, round(capacity / ((watermarks[0] + watermarks[1]) / 2)))
        high, low = round(watermarks[0] * room), round(watermarks[1] * room)
    tier: OrderedDict[bytes, None] = OrderedDict()
    front: OrderedDict[bytes, None] = OrderedDict()
    sketch = FrequencySketch(TierConfig.model_fields["admission_sketch_width"].default)
    gate: ReusePolicy | AdaptivePolicy | None = None
    requested = hit = tier_hit = written = evicted = 0
    clock = 0.0
    if policy == "reuse":
        gate = ReusePolicy(sketch, min_sightings)
    elif policy == "adaptive":
        # The replay's own clock: one probe interval per request, so the
        # eviction hold spans requests, not however long the machine takes.
        signal = CapacitySignal(lambda: (len(tier), room), None, _OneBlockFrames(), 1,
                                evictions=lambda: evicted, clock=lambda: clock)
        gate = AdaptivePolicy(sketch, signal, write_cost=write_cost)
    elif policy != "always":
        raise ValueError(f"no policy {policy!r} (have always, reuse, adaptive)")

    def enter_primary(k: bytes) -> None:
        front[k] = None
        front.move_to_end(k)
        if len(front) > primary:
            front.popitem(last=False)

    for req in requests:
        keys = [key(h) for h in req.hash_ids]
        requested += len(keys)
        served = 0
        loaded = []
        for k in keys:  # the leading hits: the primary's, else the tier's
            if primary and k in front:
                front.move_to_end(k)
            elif k in tier:
                tier.move_to_end(k)
                loaded.append(k)
            else:
                break
            served += 1
        hit += served
        tier_hit += len(loaded)
        if loaded and gate is not None:
            gate.seen(loaded)
        if primary:
            for k in loaded:
                enter_primary(k)
        offered: list[bytes] = []
        offered_set: set[bytes] = set()
        for k in keys[served:]:
            if primary and k in front:  # in the primary already: not stored again
                front.move_to_end(k)
                continue
            if primary:
                enter_primary(k)
            if k in tier:  # the tier has it (its presence index drops it)
                tier.move_to_end(k)
            elif k not in offered_set:
                offered.append(k)
                offered_set.add(k)
        if offered:
            admitted = gate.admit(offered) if gate is not None else None
            for i in range(len(offered)) if admitted is None else admitted:
                tier[offered[i]] = None
                written += 1
                if len(tier) > high:
                    while len(tier) > low:
                        tier.popitem(last=False)
                        evicted += 1
        if isinstance(gate, AdaptivePolicy):
            clock += PROBE_INTERVAL_S
            gate.signal.refresh()
            gate.update()
    return {"block_hit_rate": hit / requested if requested else 0.0,
            "tier_block_hit_rate": tier_hit / requested if requested else 0.0,
            "blocks_written": written, "evictions": evicted}


def first_sight_sources(requests: Sequence[TraceRequest], capacity: int) -> dict[str, Any]:
    """Write everything into an LRU of ``capacity`` blocks; of the blocks written
    at their first sighting, how many were read before eviction, and the hits
    they served while that first copy was cached, by bucket of each feature
    (see the module doc)."""
    cache: OrderedDict[int, None] = OrderedDict()
    seen: set[int] = set()
    first_copy: set[int] = set()  # blocks whose first-sight write is still cached
    features: dict[int, tuple[str, str]] = {}
    hits_of: defaultdict[int, int] = defaultdict(int)
    for req in requests:
        ids = req.hash_ids
        missed = False
        prefix_hits = 0
        for i, h in enumerate(ids):
            first = h not in seen
            seen.add(h)
            if not missed and h in cache:
                cache.move_to_end(h)
                prefix_hits += 1
                if h in first_copy:
                    hits_of[h] += 1
                continue
            missed = True
            if h in cache:
                cache.move_to_end(h)
                continue
            cache[h] = None
            if first:
                features[h] = (_bucket(len(ids) - 1 - i, _AFTER), _bucket(prefix_hits, _PREFIX))
                first_copy.add(h)
            if len(cache) > capacity:
                first_copy.discard(cache.popitem(last=False)[0])
    out: dict[str, Any] = {
        "first_sight_writes": len(features),
        "useful": sum(1 for h in features if hits_of[h]),
        "hits_served": sum(hits_of[h] for h in features),
    }
    for f, name in enumerate(("distance_from_end", "prefix_hits")):
        table: dict[str, dict[str, int]] = {}
        for h, feats in features.items():
            row = table.setdefault(feats[f], {"writes": 0, "useful": 0, "hits": 0})
            row["writes"] += 1
            row["useful"] += hits_of[h] > 0
            row["hits"] += hits_of[h]
        out[name] = table
    return out


def run(requests: Sequence[TraceRequest], percents: Sequence[float] = PERCENTS,
        min_sightings: int = 2, salt: str = "",
        watermarks: tuple[float, float] | None = None,
        write_cost: float = WRITE_COST) -> dict[str, Any]:
    distinct = distinct_blocks(list(requests))
    primary = primary_blocks(requests)
    key = salted_key(salt)
    rows = []
    for pct in percents:
        cap = trace_reference.capacity_blocks(distinct, pct)
        row: dict[str, Any] = {"percent": pct, "capacity_blocks": cap}
        for name, pol in (("always", "always"), ("second_sight", "reuse")):
            ref = trace_reference.replay(requests, cap, pol, min_sightings)
            row[name] = {"block_hit_rate": ref.block_hit_rate, "blocks_written": ref.blocks_written,
                         "evictions": ref.evictions}
        for pol in ("reuse", "adaptive"):
            row[pol] = policy_replay(requests, cap, pol, min_sightings, key=key,
                                     watermarks=watermarks, write_cost=write_cost)
        for pol in ("always", "reuse", "adaptive"):
            row[f"{pol}_behind_primary"] = policy_replay(requests, cap, pol, min_sightings,
                                                         primary=primary, key=key,
                                                         watermarks=watermarks,
                                                         write_cost=write_cost)
        row["first_sight"] = first_sight_sources(requests, cap)
        rows.append(row)
        print(f"{pct:g} %: " + "; ".join(
            f"{k} {row[k]['block_hit_rate']:.3f} / {row[k]['blocks_written']:,}"
            for k in ("always", "second_sight", "reuse", "adaptive", "always_behind_primary",
                      "reuse_behind_primary", "adaptive_behind_primary")), flush=True)
    return {"requests": len(requests), "distinct_blocks": distinct, "primary_blocks": primary,
            "salt": salt, "watermarks": watermarks, "write_cost": write_cost, "rows": rows}


def markdown(result: dict[str, Any]) -> str:
    """The result as three tables: hit rate and writes with the tier alone; the same
    behind the primary; where write-everything's first-sight writes pay."""
    lines = ["| capacity | always: hit rate / blocks written | second sight (exact) | "
             "`reuse` (2) | `adaptive` |", "|---|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['percent']:g} % | " + " | ".join(
            f"{row[k]['block_hit_rate']:.3f} / {row[k]['blocks_written']:,}"
            for k in ("always", "second_sight", "reuse", "adaptive")) + " |")
    lines += ["", f"Behind a primary of {result['primary_blocks']:,} blocks (hit rate of "
              "primary and tier / tier's share / blocks written):", "",
              "| capacity | always | `reuse` (2) | `adaptive` |", "|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['percent']:g} % | " + " | ".join(
            f"{row[k]['block_hit_rate']:.3f} / {row[k]['tier_block_hit_rate']:.3f} / "
            f"{row[k]['blocks_written']:,}"
            for k in ("always_behind_primary", "reuse_behind_primary",
                      "adaptive_behind_primary")) + " |")
    lines += ["", "| capacity | first-sight writes (always) | read before eviction | "
              "hits they served | best bucket: share read |", "|---|---|---|---|---|"]
    for row in result["rows"]:
        fs = row["first_sight"]
        best = max(((name, b) for feat in ("distance_from_end", "prefix_hits")
                    for name, b in fs[feat].items() if b["writes"] >= 1000),
                   key=lambda nb: nb[1]["useful"] / nb[1]["writes"], default=None)
        best_s = (f"{best[0]}: {best[1]['useful'] / best[1]['writes']:.2f} of "
                  f"{best[1]['writes']:,}" if best else "-")
        share = fs["useful"] / fs["first_sight_writes"] if fs["first_sight_writes"] else 0.0
        lines.append(f"| {row['percent']:g} % | {fs['first_sight_writes']:,} | "
                     f"{fs['useful']:,} ({share:.2f}) | {fs['hits_served']:,} | {best_s} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path, help="a request trace (Mooncake JSONL, "
                    "prefix-block ids), e.g. mooncake-conversation.jsonl")
    ap.add_argument("--requests", type=int, help="replay only the first N requests")
    ap.add_argument("--percent", type=float, action="append", help="capacities in %% of "
                    "the distinct blocks (repeatable; default 2 5 10 20 50 100)")
    ap.add_argument("--salt", default="", help="hash the block ids under this salt: "
                    "another sample of the keys for adaptive's miniatures")
    ap.add_argument("--watermarks", type=float, nargs=2, metavar=("HIGH", "LOW"),
                    help="the policies' tier evicts in rounds between these shares of "
                    "its room, as an fs evictor does (a LOW above HIGH is HIGH; bench "
                    "--trace: 0.95 0.5); the exact references stay plain LRU caches")
    ap.add_argument("--write-cost", type=float, default=WRITE_COST, help="adaptive's cost "
                    "of a write in hits, 0-1, as the tier's admission_write_cost (default: "
                    "%(default)s, its default)")
    ap.add_argument("--json", type=Path, help="write the full result here")
    args = ap.parse_args(argv)
    if not args.trace.is_file():
        ap.error(f"argument trace: {args.trace} is not a file (the Mooncake trace: "
                 "docs/write-economics.md, Method)")
    watermarks = None
    if args.watermarks:
        try:
            watermarks = fs_watermarks({"high_watermark": args.watermarks[0],
                                        "low_watermark": args.watermarks[1]})
        except ValueError as exc:
            ap.error(f"--watermarks: {exc}")
    try:
        validate_config(TierConfig, "fs", {"admission_write_cost": args.write_cost})
    except ValueError as exc:
        ap.error(f"--write-cost: {exc}")
    t0 = time.monotonic()
    result = run(load(args.trace, args.requests), args.percent or PERCENTS, salt=args.salt,
                 watermarks=watermarks,
                 write_cost=args.write_cost)
    result["seconds"] = round(time.monotonic() - t0, 1)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(markdown(result))


if __name__ == "__main__":
    main()
