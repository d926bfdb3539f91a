"""The redis tier follows the server's eviction events (``eviction_events``).

Real redis-servers with a small ``maxmemory``: blocks Redis evicts must stop
being hits in the storing process's presence index (no failed promotion,
``load_misses`` stays 0), while with ``eviction_events: off`` the same run
shows the stale hits the listener removes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import redis
from vllm.v1.kv_offload.base import LookupResult

from kvstore_tiers.admin.harness import make_keys
from kvstore_tiers.backends.redis.evictions import missing_flags
from kvstore_tiers.errors import ConfigError

from ...conftest import rows_like
from ...servers import RedisCluster, RedisServer

HIT = LookupResult.HIT
ROW = 16384
LRU = ["--maxmemory-policy", "allkeys-lru"]


def tier_cfg(url: str, **kw: Any) -> dict[str, Any]:
    return {"type": "redis", "url": url, "compression": "none", "n_read_threads": 2,
            "n_write_threads": 2, **kw}


def wait_for(cond: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.01)


def cap_memory(client: redis.Redis, extra: int) -> None:
    """``maxmemory`` = what the server uses now + ``extra`` bytes."""
    client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + extra)


def store_in_waves(h: Any, keys: list[bytes], rows: np.ndarray, wave: int = 16) -> None:
    # One request per wave: the primary holds a few waves, Redis far fewer blocks.
    for start in range(0, len(keys), wave):
        h.store_all(keys[start:start + wave], rows[start:start + wave])


def look_up_all(h: Any, keys: list[bytes]) -> tuple[list[bytes], Any]:
    """A new request looks every key up (promotions included); the hits and their rows."""
    h.forget_primary()
    ctx = h.new_request()
    results, _ = h.lookup_until_resolved(keys, ctx)
    hits = [k for k, r in zip(keys, results, strict=True) if r == HIT]
    got = h.load(hits, ctx) if hits else None
    h.finish_request(ctx)
    return hits, got


@pytest.mark.parametrize(("mode", "server_flags"), [("auto", "Ee"), ("on", ""), ("off", "Ee")])
def test_evicted_blocks_stop_being_hits(redis_server_factory, harness_factory, mode,
                                        server_flags):
    server: RedisServer = redis_server_factory(
        [*LRU, "--notify-keyspace-events", server_flags])
    with server.client() as admin:
        cap_memory(admin, 40 * ROW)
        h = harness_factory([tier_cfg(server.url, eviction_events=mode, enable_kv_events=True)],
                            num_chunks=64, chunk_bytes=ROW)
        tier = h.tiers[0]
        keys, rows = make_keys(160, seed=5), rows_like(160, ROW, seed=5)
        store_in_waves(h, keys, rows)
        # No evictions from here on: the loads' replies (client output buffers
        # count as used memory) would evict blocks between lookup and load.
        admin.config_set("maxmemory", 0)
        evicted = int(admin.info("stats")["evicted_keys"])
        assert evicted > 40, "the run must make Redis evict"
        if mode != "off":
            assert "e" in admin.config_get("notify-keyspace-events")["notify-keyspace-events"]
            wait_for(lambda: tier.backend.evictions.objects == evicted,
                     "the listener heard every eviction")
            assert tier.backend.evictions.for_capacity == evicted
        held = {k for k in keys if admin.exists(tier.backend.key(tier.namespace.object_name(k)))}
        h.step()  # the poll that hands the heard evictions to the presence index
        # kv events, in order: with the evictions heard, a consumer's view ends as
        # what Redis holds (a block evicted while its store was in flight is in
        # neither event); without them, every block stays "stored".
        view: dict[bytes, bool] = {}
        for e in tier.take_events():
            view.update(dict.fromkeys(e.keys, not e.removed))
        believed = {k for k, stored in view.items() if stored}
        assert believed == (held if mode != "off" else set(keys))

        hits, got = look_up_all(h, keys)
        # Only blocks Redis still holds are hits, and they come back byte-exact.
        assert set(hits) <= held and len(hits) >= len(held) // 2
        index = {k: i for i, k in enumerate(keys)}
        assert np.array_equal(got, rows[[index[k] for k in hits]])
        if mode == "off":
            assert tier.backend.evictions is None  # not following: nothing to report
            assert tier.counters.load_misses > 0  # stale hits: failed promotions
        else:
            assert tier.counters.load_misses == 0
            assert not tier.backend.evictions.keys  # all taken by the presence index

        # Once forgotten, an evicted block is stored again by the next store.
        if mode != "off":
            gone = [k for k in keys if k not in held][:8]
            before = tier.counters.objects_stored
            h.store_all(gone, rows[[index[k] for k in gone]])
            assert tier.counters.objects_stored == before + len(gone)


def test_auto_without_the_server_flags_follows_nothing(redis_server_factory, harness_factory,
                                                       caplog):
    server = redis_server_factory(LRU)
    with caplog.at_level(logging.INFO, logger="kvstore_tiers"):
        h = harness_factory([tier_cfg(server.url)], num_chunks=8, chunk_bytes=4096)
    assert h.tiers[0].backend._evictions is None
    assert "CONFIG SET notify-keyspace-events Ee" in caplog.text
    with server.client() as admin:  # auto never changes the server
        assert admin.config_get("notify-keyspace-events")["notify-keyspace-events"] == ""


def test_on_with_ttl_enables_expiry_events_too(redis_server_factory, harness_factory):
    server = redis_server_factory([*LRU, "--notify-keyspace-events", "Kg"])
    h = harness_factory([tier_cfg(server.url, eviction_events="on", ttl_s=1)],
                        num_chunks=8, chunk_bytes=4096)
    tier = h.tiers[0]
    with server.client() as admin:
        flags = admin.config_get("notify-keyspace-events")["notify-keyspace-events"]
    assert missing_flags(flags, "KgEex") == ""  # the server's own flags are kept
    keys = make_keys(3, seed=9)
    h.store_all(keys, rows_like(3, 4096, seed=9))
    wait_for(lambda: tier.backend.evictions.objects == 3, "expiry events heard", timeout_s=15)
    assert tier.backend.evictions.for_capacity == 0  # expired: the tier is not full
    h.step()
    assert not any(k in tier.presence for k in keys)


def test_on_fails_startup_naming_the_key_when_config_is_refused(redis_server_factory,
                                                                 harness_factory):
    server = redis_server_factory([*LRU, "--rename-command", "CONFIG", ""])
    with pytest.raises(ConfigError, match="eviction_events"):
        harness_factory([tier_cfg(server.url, eviction_events="on")])
    # auto: the setting cannot be read, so the tier follows the events in case
    # the service enabled them, and starts.
    h = harness_factory([tier_cfg(server.url)], num_chunks=8, chunk_bytes=4096)
    assert h.tiers[0].backend._evictions is not None


def test_only_this_namespace_is_taken_and_a_lost_connection_resubscribes(
        redis_server_factory, harness_factory):
    server = redis_server_factory([*LRU, "--notify-keyspace-events", "Ee"])
    h = harness_factory([tier_cfg(server.url)], num_chunks=8, chunk_bytes=4096)
    backend = h.tiers[0].backend
    key = make_keys(1, seed=3)[0]
    ours = backend.key(backend.namespace.object_name(key)).encode()
    channel = "__keyevent@0__:evicted"
    with server.client() as admin:
        wait_for(lambda: admin.pubsub_numsub(channel)[0][1] == 1, "listener subscribed")
        other_ns = ours.replace(backend.namespace.name.encode(), b"other_model_0123456789ab")
        for foreign in (b"kvstore2:" + ours[len(b"kvstore:"):], other_ns, b"session:42",
                        b"kvstore:" + backend.namespace.name.encode() + b"/not-a-block"):
            admin.publish(channel, foreign)
        admin.publish(channel, ours)
        wait_for(lambda: len(backend.evictions.keys) == 1, "our key heard")
        assert list(backend.evictions.keys) == [key] and backend.evictions.objects == 1

        admin.client_kill_filter(_type="pubsub")
        wait_for(lambda: admin.pubsub_numsub(channel)[0][1] == 1, "listener resubscribed")
        admin.publish(channel, ours)
        wait_for(lambda: backend.evictions.objects == 2, "heard after reconnecting")

    h.shutdown()  # the listener stops with the tier
    assert all(not t.is_alive() for t in backend_threads(backend))


def backend_threads(backend: Any) -> list[Any]:
    import threading

    return [t for t in threading.enumerate() if t.name.startswith("kvstore-redis-evictions")]


def test_cluster_follows_every_primary(redis_cluster: RedisCluster, harness_factory):
    h = harness_factory([{"type": "redis", "nodes": redis_cluster.addresses,
                          "compression": "none", "eviction_events": "on",
                          "n_read_threads": 2, "n_write_threads": 2}],
                        num_chunks=64, chunk_bytes=ROW)
    tier = h.tiers[0]
    clients = [n.client() for n in redis_cluster.nodes]
    try:
        for c in clients:
            assert "e" in c.config_get("notify-keyspace-events")["notify-keyspace-events"]
            c.config_set("maxmemory-policy", "allkeys-lru")
            cap_memory(c, 20 * ROW)
        keys, rows = make_keys(200, seed=11), rows_like(200, ROW, seed=11)
        store_in_waves(h, keys, rows)
        per_node = [int(c.info("stats")["evicted_keys"]) for c in clients]
        assert all(n > 0 for n in per_node), per_node
        wait_for(lambda: tier.backend.evictions.objects == sum(per_node),
                 "the listener heard every node's evictions")
    finally:
        for c in clients:
            c.close()


def test_a_user_refused_the_channels_is_told_once_and_not_retried(redis_server_factory,
                                                                  harness_factory, caplog):
    server = redis_server_factory([*LRU, "--notify-keyspace-events", "Ee"])
    with server.client() as admin:
        admin.acl_setuser("kv", enabled=True, passwords=["+kv-secret-7"], keys=["~*"],
                          commands=["+@all"], reset_channels=True)
    with caplog.at_level(logging.WARNING, logger="kvstore_tiers"):
        h = harness_factory([tier_cfg(server.url, username="kv", password="kv-secret-7")],
                            num_chunks=8, chunk_bytes=4096)
        wait_for(lambda: not any(t.is_alive() for t in backend_threads(None)),
                 "the listener gave up")
    assert "refuses the eviction events' channels" in caplog.text
    assert "kv-secret-7" not in caplog.text
    with server.client() as admin:  # one refused connection, no reconnect loop
        time.sleep(1.0)
        assert admin.info("stats")["total_connections_received"] < 8
    keys = make_keys(2, seed=4)  # the tier itself works
    h.store_all(keys, rows_like(2, 4096, seed=4))
    assert h.tiers[0].counters.objects_stored == 2


@pytest.mark.parametrize("server_flags", ["Eeg", "Ee"])
def test_blocks_another_process_deleted_leave_the_index_where_the_server_says(
        redis_server_factory, harness_factory, server_flags):
    """With ``g`` the ``del`` keyevent is followed too (DEL and UNLINK, e.g. a gc run
    elsewhere): those blocks stop being hits and go out as removed kv events, without
    counting as evictions. Without ``g`` nothing is heard: they stay stale hits."""
    server = redis_server_factory([*LRU, "--notify-keyspace-events", server_flags])
    h = harness_factory([tier_cfg(server.url, enable_kv_events=True)], num_chunks=16,
                        chunk_bytes=4096)
    tier = h.tiers[0]
    keys, rows = make_keys(12, seed=21), rows_like(12, 4096, seed=21)
    h.store_all(keys, rows)
    list(tier.take_events())  # the stored events
    gone, kept = keys[:4], keys[4:]
    name = lambda k: tier.backend.key(tier.namespace.object_name(k))  # noqa: E731
    with server.client() as admin:
        wait_for(lambda: admin.pubsub_numsub("__keyevent@0__:evicted")[0][1] == 1,
                 "listener subscribed")
        # Subscribed to del only where the server publishes it.
        assert admin.pubsub_numsub("__keyevent@0__:del")[0][1] == (server_flags == "Eeg")
        admin.delete(*(name(k) for k in gone[:2]))
        admin.unlink(*(name(k) for k in gone[2:]))
        # A barrier, not a wait: an evicted event published after the deletions
        # reaches the listener after any event they caused (one connection, in order).
        marker = make_keys(1, seed=99)[0]
        admin.publish("__keyevent@0__:evicted", name(marker))
        wait_for(lambda: tier.backend.evictions.objects == 1, "the marker heard")
    heard = list(tier.backend.evictions.keys)
    h.step()
    if server_flags == "Eeg":
        assert sorted(heard) == sorted([*gone, marker])
        assert not any(k in tier.presence for k in gone)
        assert all(k in tier.presence for k in kept)
        removed = [k for e in tier.take_events() if e.removed for k in e.keys]
        assert sorted(removed) == sorted(gone)  # the marker was never in the index
        hits, got = look_up_all(h, keys)
        assert sorted(hits) == sorted(kept) and tier.counters.load_misses == 0
        index = {k: i for i, k in enumerate(keys)}
        assert np.array_equal(got, rows[[index[k] for k in hits]])
    else:
        assert heard == [marker]
        assert all(k in tier.presence for k in keys)  # stale: their loads will miss
    assert tier.backend.evictions.objects == 1  # the marker: the deletions are not evictions
