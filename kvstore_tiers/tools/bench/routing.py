"""How the fleet replay (:mod:`.fleet`) deals a trace's requests to its nodes.

Four routings, each a function of the requests in trace order (a router sees
a request once the ones before it were dealt):

* ``round-robin``: request i to node ``i mod N``. Even load, no locality.
* ``affinity``: a consistent hash of the request's prefix (:func:`affinity_key`)
  onto the nodes with jump consistent hash (Lamping and Veach, 2014: no ring
  to keep, an even spread of keys, and only 1/(N+1) of them move when a node
  is added). Locality, but a node gets as many requests as its keys bring: on
  a trace whose prefixes are few and unequal, far more than its share.
* ``bounded``: consistent hashing with bounded loads (Mirrokni, Thorup and
  Zadimoghaddam, SODA 2018). No node may hold more than
  ``ceil(load_factor * (dealt + 1) / N)`` requests; a request goes to its
  affinity node unless that one is full, else to the next node of the key's
  own probe sequence that is not. The same prefix overflows to the same
  second node, so locality survives the bound.
* ``cache-aware``: the rule of SGLang's router (and of llm-d's and vLLM
  production-stack's, which weigh the same two things): if the load is
  imbalanced (the busiest node has more than ``balance_abs`` requests more
  than the idlest AND more than ``balance_rel`` times as many), the idlest
  node; else the node with the longest match of the request's prefix among
  the blocks routed to it, if that match covers at least ``cache_threshold``
  of the request; else the node that was routed the fewest blocks (the most
  room for a new prefix). The router keeps per node the set of block ids it
  routed there (SGLang keeps a radix tree of the text; by the traces' chain
  property a set of block ids is the same tree).

**Load.** A router in front of engines balances requests in flight. The
replay deals one request at a time (:mod:`.fleet`), so nothing is in flight
when the next one is routed: the load of a node here is the number of
requests dealt to it so far, which is what the reported max/mean measures.
Requests that cost about the same make the two the same over time.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstore_tiers.tools.bench.trace import block_key
from kvstore_tiers.tools.bench.trace_file import TraceRequest

ROUTINGS = ("round-robin", "affinity", "bounded", "cache-aware")
#: Probes of the bounded router's sequence before it takes the least-loaded node
#: (with a load factor above 1 some node always has room; this only bounds the walk).
MAX_PROBES = 64


@dataclass(frozen=True)
class RoutingKnobs:
    """The tunables of the routings (defaults: the ones docs/fleet.md recommends)."""

    affinity_blocks: int = 2
    #: ``bounded``: no node above this multiple of the mean (Mirrokni et al.'s 1 + epsilon).
    load_factor: float = 1.25
    #: ``cache-aware``: SGLang router's ``--cache-threshold`` (its default: 0.3).
    cache_threshold: float = 0.3
    #: ``cache-aware``: ``--balance-abs-threshold`` (SGLang's default 64 is for
    #: requests in flight; here loads are requests dealt, see the module doc).
    balance_abs: int = 8
    #: ``cache-aware``: ``--balance-rel-threshold`` (SGLang's default: 1.5).
    balance_rel: float = 1.2


def jump_hash(key: int, buckets: int) -> int:
    """Jump consistent hash (Lamping and Veach, 2014) of the 64-bit ``key`` onto
    ``range(buckets)``: growing ``buckets`` by one moves a key only to the new bucket."""
    key &= (1 << 64) - 1
    b, j = -1, 0
    while j < buckets:
        b = j
        key = (key * 2862933555777941757 + 1) & ((1 << 64) - 1)
        j = int((b + 1) * ((1 << 31) / ((key >> 33) + 1)))
    return b


def affinity_key(req: TraceRequest, blocks: int) -> int:
    """The routing key of ``req``: the first 8 bytes of the vLLM block hash of its
    block at position ``blocks - 1`` (its last if it has fewer)."""
    block = req.hash_ids[min(blocks, len(req.hash_ids)) - 1]
    return int.from_bytes(block_key(block)[:8], "little")


def probe_sequence(key: int, nodes: int) -> list[int]:
    """Every node once, in the order the bounded router tries them for ``key``: its
    jump hash first (the affinity node), then the jump hashes of the key rehashed
    with the probe number (skipping nodes already in the list), then the rest in order."""
    seq = [jump_hash(key, nodes)]
    seen = set(seq)
    for i in range(1, MAX_PROBES):
        if len(seq) == nodes:
            break
        salted = hashlib.blake2b(b"%d:%d" % (key, i), digest_size=8).digest()
        n = jump_hash(int.from_bytes(salted, "little"), nodes)
        if n not in seen:
            seen.add(n)
            seq.append(n)
    return seq + [n for n in range(nodes) if n not in seen]


def _bounded(requests: Sequence[TraceRequest], nodes: int, knobs: RoutingKnobs) -> list[int]:
    loads = [0] * nodes
    out = []
    for dealt, req in enumerate(requests):
        cap = math.ceil(knobs.load_factor * (dealt + 1) / nodes)
        seq = probe_sequence(affinity_key(req, knobs.affinity_blocks), nodes)
        node = next(n for n in seq if loads[n] < cap)
        loads[node] += 1
        out.append(node)
    return out


def _cache_aware(requests: Sequence[TraceRequest], nodes: int, knobs: RoutingKnobs
                 ) -> list[int]:
    loads = [0] * nodes
    seen: list[set[int]] = [set() for _ in range(nodes)]
    out = []
    for req in requests:
        hi, lo = max(loads), min(loads)
        if hi - lo > knobs.balance_abs and hi > knobs.balance_rel * lo:
            node = loads.index(lo)
        else:
            match = [_leading(req.hash_ids, s) for s in seen]
            best = max(range(nodes), key=lambda n: (match[n], -loads[n]))
            if match[best] >= knobs.cache_threshold * len(req.hash_ids):
                node = best
            else:
                node = min(range(nodes), key=lambda n: (len(seen[n]), loads[n]))
        loads[node] += 1
        seen[node].update(req.hash_ids)
        out.append(node)
    return out


def _leading(ids: Sequence[int], held: set[int]) -> int:
    """How many of ``ids``, from the first, ``held`` holds."""
    for i, b in enumerate(ids):
        if b not in held:
            return i
    return len(ids)


def route(requests: Sequence[TraceRequest], nodes: int, routing: str,
          knobs: RoutingKnobs | None = None) -> list[int]:
    """The node of each request under ``routing`` (:data:`ROUTINGS`)."""
    knobs = knobs or RoutingKnobs()
    if routing == "round-robin":
        return [i % nodes for i in range(len(requests))]
    if routing == "affinity":
        return [jump_hash(affinity_key(r, knobs.affinity_blocks), nodes) for r in requests]
    if routing == "bounded":
        return _bounded(requests, nodes, knobs)
    if routing == "cache-aware":
        return _cache_aware(requests, nodes, knobs)
    raise ValueError(f"unknown routing {routing!r} (have {ROUTINGS})")


def balance(assignment: Sequence[int], nodes: int) -> dict[str, Any]:
    """Requests per node of ``assignment`` and the busiest node's load over the mean
    (1.0: even; ``nodes``: all on one)."""
    per_node = [0] * nodes
    for n in assignment:
        per_node[n] += 1
    mean = len(assignment) / nodes
    return {"requests_per_node": per_node,
            "max_over_mean": max(per_node) / mean if mean else None}
