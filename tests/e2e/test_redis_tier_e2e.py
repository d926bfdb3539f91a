"""Two vLLM processes share a redis tier: the second is served from it, with identical output.

Phase 1 and phase 2 are separate engine processes (tests/e2e/e2e_helpers.run)
pointed at one redis-server started by the test: what phase 1 computed is in
Redis, phase 2 starts with empty GPU/CPU caches and gets every full chunk of
its first prompt from the tier, and generates the same tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_helpers import DISTINCT_CHUNKS, assert_served_from_tier, run, tier_counters

from tests.servers import RedisServer

pytestmark = pytest.mark.engine


@pytest.fixture
def e2e_redis(tmp_path: Path) -> Iterator[RedisServer]:
    srv = RedisServer(tmp_path / "redis", ["--maxmemory", "512mb",
                                           "--maxmemory-policy", "allkeys-lru"]).start()
    yield srv
    srv.stop()


def test_second_process_is_served_from_redis(
        e2e_redis: RedisServer, tiny_model: Path, tmp_path: Path) -> None:
    tiers = [{"type": "redis", "url": e2e_redis.url, "key_prefix": "e2e:"}]
    cold = run("redis-cold", tiny_model, tiers, tmp_path / "runs")
    assert all(p["external_hit_tokens"] == 0 for p in cold["prompts"]), "tier was not empty"
    assert tier_counters(cold)["objects_stored"] == DISTINCT_CHUNKS
    with e2e_redis.client() as c:
        keys = [k for k in c.scan_iter(match="e2e:*") if k.endswith(b".kvf")]
    assert len(keys) == DISTINCT_CHUNKS

    warm = run("redis-warm", tiny_model, tiers, tmp_path / "runs")
    assert_served_from_tier(cold, warm, "redis")
