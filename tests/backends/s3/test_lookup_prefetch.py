"""Existence checks that GET: a fresh engine's lookup of a stored prefix sends one GET per
block, and the load that follows takes the body the lookup fetched (``lookup_prefetch_bytes``);
past the budget, or with it 0, lookups HEAD and loads GET as before."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest

from kvstore_tiers.backends.s3 import backend as s3_backend
from kvstore_tiers.backends.s3.backend import WARM_KEY

from ...faults.faultproxy import FaultProxy
from .s3_helpers import HIT, fetch, harness, make_keys, random_rows

ROW = 16384


def _stored(cfg: dict[str, Any], n: int, seed: int) -> tuple[list[bytes], np.ndarray]:
    keys, rows = make_keys(n, seed=seed), random_rows(n, ROW, seed=seed)
    writer = harness(cfg)
    try:
        writer.store_all(keys, rows)
    finally:
        writer.shutdown()
    return keys, rows


def _fresh_fetch(cfg: dict[str, Any], keys: list[bytes]) -> tuple[list[Any], Any, Counter[str],
                                                                   Any]:
    """A fresh engine looks ``keys`` up and loads them: (results, rows, requests sent, backend)."""
    reader = harness(cfg)
    try:
        backend = reader.tiers[0].backend
        before = Counter(backend.requests)
        results, got, _ = fetch(reader, keys)
        return results, got, Counter(backend.requests) - before, backend
    finally:
        reader.shutdown()


def test_a_fresh_engine_sends_one_get_per_block(tier_config: Any) -> None:
    cfg = tier_config(compression="none")
    keys, rows = _stored(cfg, 12, seed=71)
    results, got, sent, backend = _fresh_fetch(cfg, keys)
    assert results == [HIT] * 12 and np.array_equal(got, rows)
    assert sent == Counter({"GetObject": 12}), sent
    assert backend._held.nbytes == 0 and len(backend._held) == 0  # all taken by the loads


@pytest.mark.parametrize(("thp", "huge_pages", "arena"), [
    (True, True, True), (False, True, False), (True, False, False)],
    ids=["arena", "no-thp", "huge-pages-off"])
def test_bodies_land_in_the_arena_or_the_client_s_bytes_alike(
        tier_config: Any, monkeypatch: pytest.MonkeyPatch, thp: bool, huge_pages: bool,
        arena: bool) -> None:
    cfg = tier_config(compression="none", huge_pages=huge_pages)
    keys, rows = _stored(cfg, 6, seed=74)
    monkeypatch.setattr(s3_backend, "huge_pages_available", lambda: thp)
    taken: list[int] = []
    real_take = s3_backend.BodyArena.take

    def take(self: Any, nbytes: int) -> memoryview:
        taken.append(nbytes)
        return real_take(self, nbytes)

    monkeypatch.setattr(s3_backend.BodyArena, "take", take)
    results, got, sent, backend = _fresh_fetch(cfg, keys)
    assert results == [HIT] * 6 and np.array_equal(got, rows)
    assert sent == Counter({"GetObject": 6}), sent
    assert (backend._arena is not None) is arena
    assert len(taken) == (6 if arena else 0)  # each held body, carved once
    if arena:  # a body is its frame: header and row
        assert all(n > ROW for n in taken), taken


def test_without_a_budget_lookups_head_and_loads_get(tier_config: Any) -> None:
    cfg = tier_config(compression="none", lookup_prefetch_bytes=0)
    keys, rows = _stored(cfg, 12, seed=72)
    results, got, sent, _ = _fresh_fetch(cfg, keys)
    assert results == [HIT] * 12 and np.array_equal(got, rows)
    assert sent == Counter({"HeadObject": 12, "GetObject": 12}), sent


def test_past_the_budget_bodies_are_not_held(tier_config: Any) -> None:
    """A budget of three frames: the first lookup (no frame size known yet) GETs every
    block but holds three; once the size is known, lookups GET what fits and HEAD the rest.
    Every block loads right, and the bytes held never pass the budget."""
    budget = 3 * ROW + 3 * 512  # three frames (a row and its header) and no fourth
    cfg = tier_config(compression="none", lookup_prefetch_bytes=budget)
    keys, rows = _stored(cfg, 12, seed=73)
    reader = harness(cfg)
    try:
        backend = reader.tiers[0].backend
        peak = 0
        reserve = backend._held.reserve

        def watched(nbytes: int) -> bool:
            nonlocal peak
            ok = reserve(nbytes)
            peak = max(peak, backend._held.nbytes)
            return ok

        backend._held.reserve = watched
        before = Counter(backend.requests)
        results, got, _ = fetch(reader, keys[:6])
        assert results == [HIT] * 6 and np.array_equal(got, rows[:6])
        # Six GETs to look up (three held), three more for the loads of the others.
        assert Counter(backend.requests) - before == Counter({"GetObject": 9})
        before = Counter(backend.requests)
        results, got, _ = fetch(reader, keys[6:])
        assert results == [HIT] * 6 and np.array_equal(got, rows[6:])
        # The frame size is known: three GETs held, three HEADs, three GETs to load.
        assert Counter(backend.requests) - before == Counter({"GetObject": 6, "HeadObject": 3})
        assert 0 < peak <= budget
    finally:
        reader.shutdown()


def test_a_body_not_loaded_in_time_is_dropped_and_the_load_gets_it(
        tier_config: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(s3_backend, "HOLD_S", 0.0)  # every held body has expired by its load
    cfg = tier_config(compression="none")
    keys, rows = _stored(cfg, 6, seed=74)
    results, got, sent, backend = _fresh_fetch(cfg, keys)
    assert results == [HIT] * 6 and np.array_equal(got, rows)
    assert sent == Counter({"GetObject": 12}), sent
    assert backend._held.nbytes == 0


def test_a_held_body_cut_short_is_fetched_again(tier_config: Any, proxy: FaultProxy) -> None:
    """The lookup's GETs answer 200 with half their bodies: the lookups still HIT (the
    server said the objects are there), and each load GETs its block again, whole."""
    keys, rows = _stored(tier_config(compression="none"), 4, seed=75)
    cfg = tier_config(compression="none", endpoint_url=proxy.url)
    reader = harness(cfg)
    try:
        backend = reader.tiers[0].backend
        proxy.truncate(count=4, methods={"GET"})
        results, got, _ = fetch(reader, keys)
        assert results == [HIT] * 4 and np.array_equal(got, rows)
        assert reader.tiers[0].counters.objects_loaded == 4
        assert backend.requests["GetObject"] == 8
    finally:
        reader.shutdown()


@pytest.mark.parametrize(("budget", "method"), [(None, "GET"), (0, "HEAD")])
def test_start_up_warms_the_operation_lookups_send(tier_config: Any, proxy: FaultProxy,
                                                   budget: int | None, method: str) -> None:
    """Once alone (the request path is built), then once per pooled connection at once."""
    extra = {} if budget is None else {"lookup_prefetch_bytes": budget}
    h = harness(tier_config(endpoint_url=proxy.url, max_concurrency=8, **extra))
    try:
        backend = h.tiers[0].backend
        warm = [m for m, p in proxy.seen if p.endswith("/" + backend.prefix + WARM_KEY)]
        assert warm == [method] * 9, proxy.seen
        assert sum(backend.requests.values()) == 0
    finally:
        h.shutdown()


@pytest.mark.parametrize("budget", [None, 0])
def test_a_fresh_engine_s_first_existence_checks_open_no_connection(
        tier_config: Any, proxy: FaultProxy, budget: int | None) -> None:
    """The proxy keeps its client connections open whatever the server behind it does."""
    extra = {} if budget is None else {"lookup_prefetch_bytes": budget}
    h = harness(tier_config(endpoint_url=proxy.url, max_concurrency=8, **extra))
    try:
        backend = h.tiers[0].backend
        opened = proxy.connections
        assert backend.exists_many([f"absent-{i}" for i in range(8)]) == [False] * 8
        assert sum(backend.requests.values()) == 8
        assert proxy.connections == opened
    finally:
        h.shutdown()
