"""A plain block-level cache replay of a trace: the reference column of ``bench --trace``.

One LRU cache of ``capacity`` blocks, nothing in flight, no primary tier:
each request looks its blocks up in order and stops at the first miss
(prefix semantics); every block from there on is computed, and written to
the cache unless the policy declines it. Policies:

* ``always``: every computed block is written (vLLM's cascade today);
* ``reuse``: a computed block is written once the trace has named it
  ``min_sightings`` times, counting every request that names it, hits
  included (write on second sight for 2).

The trace README's reference figures come from exactly this replay (the
tests check them); the real-manager replay in :mod:`.trace` is compared
against it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from kvstore_tiers.tools.bench.trace_file import TraceRequest

#: The policies this replay models (``adaptive`` has no plain-LRU twin).
POLICIES = ("always", "reuse")


@dataclass
class ReferenceResult:
    """What one reference replay counted."""

    blocks_requested: int = 0
    blocks_hit: int = 0
    tokens_requested: int = 0
    tokens_hit: int = 0
    blocks_written: int = 0
    evictions: int = 0

    @property
    def block_hit_rate(self) -> float:
        return self.blocks_hit / self.blocks_requested if self.blocks_requested else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.tokens_hit / self.tokens_requested if self.tokens_requested else 0.0

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "block_hit_rate": self.block_hit_rate,
                "token_hit_rate": self.token_hit_rate}


def replay(requests: Sequence[TraceRequest], capacity: int, policy: str = "always",
           min_sightings: int = 2) -> ReferenceResult:
    """Replay ``requests`` through an LRU of ``capacity`` blocks under ``policy``."""
    if policy not in POLICIES:
        raise ValueError(f"no reference replay for policy {policy!r} (have {POLICIES})")
    gate = min_sightings if policy == "reuse" else 0
    cache: OrderedDict[int, None] = OrderedDict()
    seen: dict[int, int] = {}
    r = ReferenceResult()
    for req in requests:
        ids = req.hash_ids
        r.blocks_requested += len(ids)
        r.tokens_requested += req.input_length
        missed = False
        for i, h in enumerate(ids):
            seen[h] = n = seen.get(h, 0) + 1
            if not missed and h in cache:
                cache.move_to_end(h)
                r.blocks_hit += 1
                r.tokens_hit += req.block_tokens(i)
                continue
            missed = True
            if h in cache:  # computed again after an earlier miss; already cached
                cache.move_to_end(h)
                continue
            if n < gate:
                continue
            cache[h] = None
            r.blocks_written += 1
            if len(cache) > capacity:
                cache.popitem(last=False)
                r.evictions += 1
    return r


def capacity_blocks(distinct: int, percent: float) -> int:
    """Blocks of a cache holding ``percent`` % of ``distinct`` blocks (at least 1)."""
    return max(1, int(distinct * percent / 100))
