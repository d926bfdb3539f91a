"""The redis tier through vLLM's real TieringOffloadingSpec/Manager (harness).

Each test drives the manager as vLLM's scheduler would -- store, settle,
forget the primary, look up until resolved, load -- against a real
redis-server, and checks what a user sees: the bytes that come back, hits
and misses, failed jobs instead of exceptions.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import redis
from vllm.v1.kv_offload.base import LookupResult

from kvstore_tiers.admin import gc_store
from kvstore_tiers.admin.harness import make_keys
from kvstore_tiers.admission import policy_of
from kvstore_tiers.errors import ConfigError
from kvstore_tiers.frame import parse_header

from ...conftest import rows_like as random_rows
from ...servers import RedisServer

HIT, MISS = LookupResult.HIT, LookupResult.MISS


def tier_cfg(server: RedisServer, **kw: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"type": "redis", "url": server.url,
                           "n_read_threads": 2, "n_write_threads": 2}
    cfg.update(kw)
    return cfg




def fetch(h: Any, keys: list[bytes]) -> tuple[list[Any], np.ndarray, Any]:
    """Forget the primary, look ``keys`` up as a new request, load the hits."""
    h.forget_primary()
    ctx = h.new_request()
    results, _ = h.lookup_until_resolved(keys, ctx)
    hits = [k for k, r in zip(keys, results, strict=True) if r == HIT]
    got = h.load(hits, ctx) if hits else np.empty((0, 0), np.uint8)
    h.finish_request(ctx)
    return results, got, ctx


def redis_keys(client: redis.Redis) -> list[bytes]:
    return sorted(k for k in client.scan_iter(match="kvstore:*") if k.endswith(b".kvf"))


@pytest.mark.parametrize(("compression", "fast_io"), [
    ("auto", True), ("none", True), ("zstd", True), ("auto", False), ("none", False)])
def test_round_trip_random_bytes(redis_server, harness_factory, compression, fast_io):
    h = harness_factory([tier_cfg(redis_server, compression=compression, fast_io=fast_io)],
                        num_chunks=32, chunk_bytes=16384)
    keys, rows = make_keys(20), random_rows(20, 16384)
    h.store_all(keys, rows)
    tier = h.tiers[0]
    assert tier.counters.objects_stored == 20 and tier.counters.store_failures == 0
    with redis_server.client() as c:
        assert len(redis_keys(c)) == 20

    results, got, _ = fetch(h, keys)
    assert results == [HIT] * 20
    assert np.array_equal(got, rows)
    assert tier.counters.objects_loaded == 20


@pytest.mark.parametrize("sample", [0, 1])
def test_round_trip_real_kv_samples_with_kvsplit(redis_server, harness_factory, kv_samples,
                                                 sample):
    """Real bf16 KV blocks come back byte-exact and take less Redis memory (kvsplit)."""
    _entry, blocks = kv_samples[sample]
    n, size = blocks.shape
    h = harness_factory([tier_cfg(redis_server)], num_chunks=n + 4, chunk_bytes=size)
    keys = make_keys(n, seed=7)
    h.store_all(keys, blocks)
    tier = h.tiers[0]
    assert tier.codec_id.name == "KVSPLIT"
    with redis_server.client() as c:
        stored = sum(c.strlen(k) for k in redis_keys(c))
    assert stored < n * size / 1.2  # the sidecar says ~1.42x for this split

    results, got, _ = fetch(h, keys)
    assert results == [HIT] * n
    assert np.array_equal(got, blocks)


def test_second_manager_finds_blocks_and_does_not_rewrite_them(redis_server, harness_factory):
    """Two engines sharing one server: B finds A's blocks (EXISTS) and loads them."""
    cfg = tier_cfg(redis_server)
    a = harness_factory([cfg], num_chunks=16, chunk_bytes=8192)
    b = harness_factory([cfg], num_chunks=16, chunk_bytes=8192)
    keys, rows = make_keys(8, seed=3), random_rows(8, 8192, seed=3)
    a.store_all(keys, rows)

    ctx = b.new_request()
    results, steps = b.lookup_until_resolved(keys, ctx)
    assert results == [HIT] * 8 and steps > 1  # answered by the async EXISTS probe
    assert np.array_equal(b.load(keys, ctx), rows)
    b.finish_request(ctx)

    # B computing the same blocks again leaves A's objects alone (SET NX).
    with redis_server.client() as c:
        before = {k: c.get(k) for k in redis_keys(c)}
    b.forget_primary()
    b.store_all(keys, rows)
    assert b.tiers[0].counters.objects_stored == 0
    assert b.tiers[0].counters.store_failures == 0
    with redis_server.client() as c:
        assert {k: c.get(k) for k in redis_keys(c)} == before


@pytest.mark.parametrize("fast_io", [True, False])
def test_ttl_is_set_refreshed_on_hit_and_expiry_is_a_miss(redis_server, harness_factory,
                                                          fast_io):
    h = harness_factory([tier_cfg(redis_server, ttl_s=1000, fast_io=fast_io)], num_chunks=16,
                        chunk_bytes=8192)
    keys, rows = make_keys(6, seed=5), random_rows(6, 8192, seed=5)
    h.store_all(keys, rows)
    with redis_server.client() as c:
        names = redis_keys(c)
        assert all(900 < c.ttl(k) <= 1000 for k in names)
        # Age the keys: 50 s left. A hit must push the expiry back to ttl_s.
        for k in names:
            c.expire(k, 50)
    results, got, _ = fetch(h, keys)
    assert results == [HIT] * 6 and np.array_equal(got, rows)
    with redis_server.client() as c:
        assert all(c.ttl(k) > 900 for k in names)
        # Now let them expire (1 ms), and wait until Redis reports them gone.
        for k in names:
            c.pexpire(k, 1)
        while any(c.pttl(k) != -2 for k in names):
            pass

    tier = h.tiers[0]
    failures_before = tier.counters.load_failures
    results, _, _ = fetch(h, keys)
    # This process stored them (its presence index says HIT), the load finds
    # nothing: a miss per key, never an error.
    assert results == [MISS] * 6
    assert tier.counters.load_misses == 6
    assert tier.counters.load_failures == failures_before

    # A fresh engine asks Redis: expired keys are a plain MISS.
    other = harness_factory([tier_cfg(redis_server, ttl_s=1000)], num_chunks=16,
                            chunk_bytes=8192)
    ctx = other.new_request()
    assert other.lookup_until_resolved(keys, ctx)[0] == [MISS] * 6


def test_eviction_under_maxmemory_allkeys_lru_is_a_miss(redis_server_factory, harness_factory):
    srv = redis_server_factory(["--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru",
                                "--maxmemory-samples", "10"])
    row = 128 * 1024
    h = harness_factory([tier_cfg(srv, compression="none")], num_chunks=48, chunk_bytes=row)
    keys, rows = make_keys(48, seed=9), random_rows(48, row, seed=9)
    for i in range(0, 48, 8):  # 6 MiB through a 3 MiB Redis
        h.store_all(keys[i:i + 8], rows[i:i + 8])
    tier = h.tiers[0]
    assert tier.counters.store_failures == 0
    with srv.client() as c:
        assert c.info("stats")["evicted_keys"] > 0
        present = {k for k in keys if c.exists(f"kvstore:{h.tiers[0].namespace.object_name(k)}")}
    assert 0 < len(present) < 48

    results, got, _ = fetch(h, keys)
    hit_idx = [i for i, r in enumerate(results) if r == HIT]
    assert {keys[i] for i in hit_idx} <= present
    assert np.array_equal(got, rows[hit_idx])
    assert tier.counters.load_failures == 0  # evicted blocks are misses, not errors
    assert tier.counters.load_misses == 48 - len(hit_idx)


def test_oom_with_noeviction_fails_stores_not_the_engine(redis_server_factory,
                                                         harness_factory, caplog):
    srv = redis_server_factory(["--maxmemory", "2mb", "--maxmemory-policy", "noeviction"])
    row = 128 * 1024
    with caplog.at_level(logging.WARNING):
        h = harness_factory([tier_cfg(srv, compression="none", failure_threshold=1000)],
                            num_chunks=40, chunk_bytes=row)
    assert "noeviction" in caplog.text and "allkeys-lru" in caplog.text
    keys, rows = make_keys(40, seed=2), random_rows(40, row, seed=2)
    for i in range(0, 40, 8):
        h.store_all(keys[i:i + 8], rows[i:i + 8])
    tier = h.tiers[0]
    assert tier.counters.store_failures > 0  # -OOM: failed jobs
    assert tier.counters.objects_stored > 0
    # What was stored still loads.
    results, got, _ = fetch(h, keys)
    hit_idx = [i for i, r in enumerate(results) if r == HIT]
    assert len(hit_idx) == tier.counters.objects_stored
    assert np.array_equal(got, rows[hit_idx])


def test_server_crash_fails_jobs_then_recovers(redis_server, harness_factory):
    # failure_threshold high: this test is about the client reconnecting, not the breaker.
    h = harness_factory([tier_cfg(redis_server, failure_threshold=1000, retries=1)],
                        num_chunks=32, chunk_bytes=8192)
    tier = h.tiers[0]
    keys, rows = make_keys(24, seed=4), random_rows(24, 8192, seed=4)
    h.store_all(keys[:8], rows[:8])
    assert tier.counters.objects_stored == 8

    redis_server.kill()
    h.store_all(keys[8:16], rows[8:16])  # no exception: failed jobs
    assert tier.counters.store_failures == 8
    results, _, _ = fetch(h, keys[:8])  # presence says HIT; the load fails -> MISS
    assert results == [MISS] * 8
    assert tier.counters.load_failures == 8

    redis_server.restart()  # same port, empty (no persistence)
    h.store_all(keys[16:], rows[16:])
    assert tier.counters.objects_stored == 16  # the pool reconnected by itself
    results, got, _ = fetch(h, keys[16:])
    assert results == [HIT] * 8 and np.array_equal(got, rows[16:])
    # Blocks lost with the crash are misses now (asked to Redis by a new request).
    assert fetch(h, keys[:8])[0] == [MISS] * 8


@pytest.mark.parametrize("fast_io", [True, False])
@pytest.mark.parametrize("damage", ["flip_payload", "truncate", "garbage", "other_key"])
def test_corrupt_and_truncated_values_are_misses(redis_server, harness_factory, damage, fast_io):
    h = harness_factory([tier_cfg(redis_server, compression="none", fast_io=fast_io)],
                        num_chunks=16, chunk_bytes=8192)
    tier = h.tiers[0]
    keys, rows = make_keys(4, seed=11), random_rows(4, 8192, seed=11)
    h.store_all(keys, rows)
    name = [f"kvstore:{tier.namespace.object_name(k)}" for k in keys]
    with redis_server.client() as c:
        bad = name[1]
        value = c.get(bad)
        if damage == "flip_payload":
            c.setrange(bad, len(value) - 10, bytes([value[-10] ^ 0xFF]))
        elif damage == "truncate":
            c.set(bad, value[: len(value) - 100])
        elif damage == "garbage":
            c.set(bad, b"not a frame at all")
        else:
            c.set(bad, c.get(name[2]))  # a valid frame, of another block
    results, got, _ = fetch(h, keys)
    assert results == [HIT, MISS, HIT, HIT]
    assert np.array_equal(got, rows[[0, 2, 3]])
    assert tier.counters.corrupt_objects == 1
    assert tier.counters.load_failures == 0
    with redis_server.client() as c:
        assert not c.exists(bad)  # the corrupt value was removed


def test_gc_by_age_and_size_and_listing(redis_server, harness_factory):
    h = harness_factory([tier_cfg(redis_server, compression="none")],
                        num_chunks=16, chunk_bytes=8192)
    tier = h.tiers[0]
    keys, rows = make_keys(10, seed=12), random_rows(10, 8192, seed=12)
    h.store_all(keys, rows)
    backend = tier.backend
    listed = list(backend.iter_objects(tier.namespace.name))
    assert len(listed) == 10 and all(o.size > 8192 for o in listed)
    names = [f"kvstore:{tier.namespace.object_name(k)}" for k in keys]
    with redis_server.client() as c:
        # Make blocks 0..3 two days old (created_ms is bytes 56..63 of the header).
        for n in names[:4]:
            created = parse_header(c.getrange(n, 0, 200)).created_ms - 2 * 86400 * 1000
            c.setrange(n, 56, created.to_bytes(8, "little"))
    # gc plans over iter_objects: the age is the frame's created_ms.
    report = gc_store(backend, max_age_s=86400, dry_run=True)
    assert report.deleted_objects == 4
    report = gc_store(backend, max_age_s=86400)
    assert (report.scanned_objects, report.deleted_objects) == (10, 4)
    with redis_server.client() as c:
        assert [bool(c.exists(n)) for n in names] == [False] * 4 + [True] * 6
    size = listed[0].size
    report = gc_store(backend, max_bytes=3 * size)
    assert report.deleted_objects == 3 and report.remaining_bytes <= 3 * size


def test_gc_of_a_tier_dict_for_the_cli(redis_server, harness_factory):
    from kvstore_tiers.admin import gc

    h = harness_factory([tier_cfg(redis_server)], num_chunks=16, chunk_bytes=8192)
    h.store_all(make_keys(5, seed=13), random_rows(5, 8192, seed=13))
    report = gc(tier_cfg(redis_server), max_age_s=0)
    assert (report.scanned_objects, report.deleted_objects) == (5, 5)
    with redis_server.client() as c:
        assert redis_keys(c) == []


def test_wrong_address_fails_startup_clearly(harness_factory):
    from ...servers import free_port

    cfg = {"type": "redis", "url": f"redis://127.0.0.1:{free_port()}/0", "retries": 0}
    with pytest.raises(ConfigError, match="cannot connect"):
        harness_factory([cfg])


def test_unknown_key_and_bad_url_fail_startup(harness_factory):
    with pytest.raises(ConfigError, match="url"):
        harness_factory([{"type": "redis", "url": "http://x"}])
    with pytest.raises(ConfigError, match="ttl"):
        harness_factory([{"type": "redis", "ttl": 5}])


def test_module_path_route(redis_server, harness_factory):
    h = harness_factory([{**tier_cfg(redis_server), "module_path": "kvstore_tiers.tiers"}],
                        num_chunks=8, chunk_bytes=4096)
    keys, rows = make_keys(3, seed=21), random_rows(3, 4096, seed=21)
    h.store_all(keys, rows)
    results, got, _ = fetch(h, keys)
    assert results == [HIT] * 3 and np.array_equal(got, rows)


def test_example_config_is_valid():
    import json
    from pathlib import Path

    from kvstore_tiers.backends.redis import RedisConfig
    from kvstore_tiers.config import validate_config

    path = Path(__file__).resolve().parents[3] / "examples" / "redis-local.json"
    cfg = json.loads(path.read_text())
    assert cfg.pop("type") == "redis"
    validate_config(RedisConfig, "redis", cfg)


def test_capacity_usage_is_used_memory_against_maxmemory(redis_server_factory,
                                                         harness_factory) -> None:
    """adaptive admission's signal: INFO memory, read off the scheduler thread."""
    srv = redis_server_factory(["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"])
    h = harness_factory([tier_cfg(srv, admission="adaptive")], num_chunks=16, chunk_bytes=8192)
    tier = h.tiers[0]
    used, limit = tier.backend.capacity_usage()
    assert limit == 64 << 20 and 0 < used < limit
    h.store_all(make_keys(8, seed=30), random_rows(8, 8192))
    assert tier.backend.capacity_usage()[0] > used
    signal = policy_of(tier).signal
    signal.refresh()
    assert signal.capacity == limit and not signal.full
    unbounded = redis_server_factory([])
    other = harness_factory([tier_cfg(unbounded)], num_chunks=16, chunk_bytes=8192)
    assert other.tiers[0].backend.capacity_usage() is None


def test_an_object_is_counted_at_its_memory_on_the_server(redis_server_factory,
                                                          harness_factory) -> None:
    """adaptive's miniatures are sized in objects the server holds: MEMORY USAGE of a
    key this process wrote (its value, name and bookkeeping), more than its frame."""
    srv = redis_server_factory(["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"])
    h = harness_factory([tier_cfg(srv, admission="adaptive", compression="none")],
                        num_chunks=16, chunk_bytes=8192)
    tier = h.tiers[0]
    assert tier.backend.object_bytes() is None  # nothing written yet
    h.store_all(make_keys(4, seed=31), random_rows(4, 8192))
    c = tier.counters
    frame = c.stored_bytes_written // c.objects_stored
    size = tier.backend.object_bytes()
    assert size is not None and frame < size < 2 * frame
    signal = policy_of(tier).signal
    signal.refresh()
    assert signal.object_size == size
    assert signal.blocks == int(signal.capacity * signal.fill) // size
