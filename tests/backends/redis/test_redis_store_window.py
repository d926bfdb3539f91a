"""The fast path's store window: many threads storing at once through a small window.

Every value must land exactly once with the right bytes, the window must be
given back in full (also when the server goes away mid-batch), and a thread
with replies outstanding must never wait on another (no deadlock).
"""

from __future__ import annotations

import threading

import pytest
import redis
from redis.backoff import ExponentialBackoff

from kvstore_tiers.backends.redis.fastio import FastIO

from ...servers import RedisServer

VALUE = 256 << 10


def _fastio(server: RedisServer, window: int, conns: int = 8) -> FastIO:
    pool = redis.BlockingConnectionPool(host="127.0.0.1", port=server.port,
                                        max_connections=conns, socket_timeout=5)
    return FastIO(pool, retries=0, backoff=ExponentialBackoff().compute,
                  set_window_bytes=window)


@pytest.mark.parametrize("window", [1, 3 * VALUE, 0])
def test_concurrent_batches_through_the_window_store_every_value(
        redis_server: RedisServer, window: int) -> None:
    fio = _fastio(redis_server, window)
    header = b"H" * 64
    results: list[list[bool | BaseException]] = []
    lock = threading.Lock()

    def writer(t: int) -> None:
        frames = [(b"w:%d:%d" % (t, i), (header, bytes([t * 16 + i]) * VALUE))
                  for i in range(6)]
        got = fio.set_many(frames, ttl_s=None)
        again = fio.set_many(frames[:2], ttl_s=None)  # NX: already there
        with lock:
            results.append(got + again)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not any(th.is_alive() for th in threads), "store threads deadlocked"
    assert sorted(map(tuple, results)) == [(True,) * 6 + (False, False)] * 6
    assert fio._inflight == 0
    c = redis_server.client()
    for t in range(6):
        for i in range(6):
            assert c.get(b"w:%d:%d" % (t, i)) == header + bytes([t * 16 + i]) * VALUE
    fio.pool.disconnect()


def test_window_is_given_back_when_the_server_dies_mid_batch(
        redis_server: RedisServer) -> None:
    fio = _fastio(redis_server, 2 * VALUE)
    frames = [(b"d:%d" % i, (b"h" * 64, b"x" * VALUE)) for i in range(8)]
    assert fio.set_many(frames[:1], ttl_s=None) == [True]
    redis_server.kill()
    with pytest.raises((redis.ConnectionError, OSError)):
        fio.set_many(frames[1:], ttl_s=None)
    assert fio._inflight == 0  # a later store is not starved by the failed one
    redis_server.start()
    assert fio.set_many(frames[1:3], ttl_s=None) == [True, True]
    assert fio._inflight == 0
    fio.pool.disconnect()
