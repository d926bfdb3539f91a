"""After a failed promotion a key answers MISS for every request (vllm#49328).

vLLM's own tiers flip the key's cached verdict to MISS (``mark_miss``), shared
by every request that looks the key up while the verdict lives. Ours does the
same: a key whose load failed answers MISS for every request until it is
stored again, or until every request that saw the verdict has finished; the
next lookup then probes the backend afresh. The request whose load failed
never retries it (vLLM #49176).
"""

from __future__ import annotations

from vllm.v1.kv_offload.base import LookupResult

from kvstore_tiers.admin.harness import make_keys

from ..conftest import rows_like
from .flaky import flaky_tier

ROW = 4096
HIT, MISS = LookupResult.HIT, LookupResult.MISS


def _lookup(h, keys, ctx) -> list[LookupResult]:
    with h.locked():
        return [h.manager.lookup(k, ctx) for k in keys]


def test_a_failed_load_is_a_miss_for_every_request_until_reprobed(
    harness_factory, tmp_path, flaky
) -> None:
    h = harness_factory([flaky_tier(tmp_path)], num_chunks=32, chunk_bytes=ROW)
    tier = h.tiers[0]
    keys = make_keys(4, seed=11)
    h.store_all(keys, rows_like(4, ROW, seed=11))
    h.forget_primary()
    flaky.dead.add(keys[0])

    a = h.new_request()
    assert h.lookup_until_resolved(keys, a)[0] == [MISS, HIT, HIT, HIT]
    failures = tier.counters.load_failures
    assert failures == 1
    for _ in range(3):  # the failing request never retries it (#49176)
        h.step()
        assert _lookup(h, keys[:1], a) == [MISS]
    b = h.new_request()  # another request sharing the key: MISS at once, no new load
    assert _lookup(h, keys[:1], b) == [MISS]
    h.step()
    assert _lookup(h, keys[:1], b) == [MISS]
    assert tier.counters.load_failures == failures

    flaky.dead.clear()  # the backend recovers
    h.finish_request(a)
    c = h.new_request()  # b still holds the verdict: still MISS
    assert _lookup(h, keys[:1], c) == [MISS]
    h.finish_request(b)
    h.finish_request(c)
    d = h.new_request()  # nobody holds it: a fresh probe, then a promotion
    assert h.lookup_until_resolved(keys[:1], d)[0] == [HIT]
    h.finish_request(d)
    assert tier.counters.load_failures == failures


def test_a_key_stored_again_is_served_again(harness_factory, tmp_path, flaky) -> None:
    h = harness_factory([flaky_tier(tmp_path)], num_chunks=32, chunk_bytes=ROW)
    keys = make_keys(2, seed=12)
    rows = rows_like(2, ROW, seed=12)
    h.store_all(keys, rows)
    h.forget_primary()
    flaky.dead.add(keys[0])
    a = h.new_request()
    assert h.lookup_until_resolved(keys, a)[0] == [MISS, HIT]
    flaky.dead.clear()
    h.store_all(keys[:1], rows[:1])  # recomputed and stored again while a lives
    h.forget_primary()
    b = h.new_request()
    assert h.lookup_until_resolved(keys[:1], b)[0] == [HIT]
    assert h.load(keys[:1], b)[0].tobytes() == rows[0].tobytes()
    h.finish_request(b)
    h.finish_request(a)
