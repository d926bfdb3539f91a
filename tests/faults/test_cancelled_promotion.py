"""A promotion cancelled by ``drain_jobs`` is no failed load (fs, s3, redis, real servers).

vLLM's ``reset_cache`` (prefix-cache reset, sleep, weight update) drains
every tier: ``drain_jobs`` cancels the queued transfers and waits for the
running ones. A cancelled slot never reached the backend, so its object is
intact: another request must be served from the tier at once, not answered
MISS until the request whose promotion was cancelled finishes.

The backend's loads are held (fs: an Event in ``load_many``; s3: the fault
proxy holds every GET; redis: the RESP proxy holds every reply) while the
promotion is submitted, so its first batches sit in I/O and the rest stay
queued; they are released once the drain has cancelled the queue.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from kvstore_tiers.admin.harness import make_keys

from ..servers import RedisServer, tier_config_factory
from .common import HIT, Driver, rows_for
from .faultproxy import FaultProxy
from .respproxy import RespProxy
from .stall import StallFsBackend

#: A promotion this long spans more tasks than the two I/O threads hold on every
#: backend (chunks per load task: fs 64, s3 16, redis 8), so some stay queued.
N_KEYS = 160
#: Two I/O threads (a read and a write thread) both take loads.
THREADS = {"n_read_threads": 1, "n_write_threads": 1}


@dataclass
class Held:
    """A tier whose backend's loads can be held and released."""

    backend: str
    tier: dict[str, Any]
    hold: Callable[[], None]
    release: Callable[[], None]


@pytest.fixture
def fs_held(tmp_path: Any) -> Iterator[Held]:
    gate = StallFsBackend.gate
    yield Held("fs", {"type": "StallFsTier", "module_path": "tests.faults.stall",
                      "root_dir": str(tmp_path), **THREADS}, gate.clear, gate.set)
    gate.set()


@pytest.fixture
def s3_held(moto_endpoint: str) -> Iterator[Held]:
    fp = FaultProxy(moto_endpoint)
    make = tier_config_factory(f"kvc-{uuid.uuid4().hex[:12]}", fp.url, "c/",
                               connect_timeout_s=0.5)
    yield Held("s3", make(create_bucket=True, max_attempts=1, read_timeout_s=30.0,
                          request_deadline_s=60.0, **THREADS),
               lambda: fp.stall(methods={"GET"}), fp.heal)
    fp.close()


@pytest.fixture
def redis_held(redis_server_factory: Callable[..., RedisServer]) -> Iterator[Held]:
    server = redis_server_factory(["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"])
    rp = RespProxy(server.port)
    yield Held("redis", {"type": "redis", "url": rp.url, "socket_timeout_s": 30.0,
                         "retries": 0, "pipeline_batch": 8, **THREADS}, rp.stall, rp.heal)
    rp.close()


def _release_once_cancelled(d: Driver, release: Callable[[], None]) -> threading.Thread:
    """Release the held loads once the drain has cancelled every queued chunk.

    The held batches keep both I/O threads busy, so only the drain's
    cancellation empties the queue; the drain then waits for the held batches.
    """
    pool = d.tier.pool

    def run() -> None:
        deadline = time.monotonic() + 30
        while pool.queued_chunks and time.monotonic() < deadline:
            time.sleep(0.001)
        release()

    t = threading.Thread(target=run, name="release-held-loads", daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("held", ["fs_held", "s3_held", "redis_held"])
def test_a_cancelled_promotion_leaves_its_keys_hits_for_other_requests(
        held: str, request: pytest.FixtureRequest) -> None:
    h: Held = request.getfixturevalue(held)
    d = Driver(h.backend, [h.tier], num_chunks=2 * N_KEYS, chunk_bytes=16384)
    try:
        keys = make_keys(N_KEYS, seed=71)
        d.store(keys, rows_for(keys, d.row_bytes))
        d.forget_primary()

        # Request a finds every key in the tier; its promotion is submitted
        # at the end of the step and its first batches are held in I/O.
        h.hold()
        a = d.call(d.h.new_request)
        d.call(d._lookup_all, keys, a)
        d.call(d.h.step)
        assert d.tier.pool.queued_chunks > 0, "nothing left queued to cancel"
        releaser = _release_once_cancelled(d, h.release)
        d.forget_primary()  # reset_cache: drain_jobs cancels the queued part
        releaser.join(timeout=60)
        d.score.fault("promotion_cancelled_by_drain")
        c = d.tier.counters
        assert c.transfers_cancelled > 0
        assert c.load_failures == 0 and c.load_misses == 0

        # While a lives, another request is served from the tier, byte-exact.
        assert d.fetch(keys) == [HIT] * N_KEYS
        d.call(d.h.finish_request, a)
        assert d.score.wrong_bytes == 0
    finally:
        h.release()
        assert d.close() == 0
