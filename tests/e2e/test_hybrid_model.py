"""A hybrid model (sliding-window and full-attention layers, two KV cache groups)
through the real engine on every backend (fs, a real redis-server, a moto S3
server): a second process is served both groups from the tier with identical
output, and a tier whose every stored object is damaged still gives identical
output."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from built_models import tiny_gemma3_model_dir
from e2e_helpers import outputs, run, tier_counters
from stored_objects import FsObjects, RedisObjects, S3Objects, StoredObjects

from tests.servers import RedisServer, s3_client

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def gemma(e2e_dir: Path, tiny_model: Path) -> Path:
    return tiny_gemma3_model_dir(e2e_dir / "tiny-gemma3", tiny_model)


@pytest.fixture(scope="module")
def gemma_baseline(gemma: Path, e2e_dir: Path) -> dict[str, Any]:
    baseline = run("gemma-baseline", gemma, None, e2e_dir / "runs")
    # an output that depends on the prompt: one that ignored the KV would prove nothing
    assert all(len(set(out)) > 2 for out in outputs(baseline)), outputs(baseline)
    assert len({tuple(out) for out in outputs(baseline)}) > 1, outputs(baseline)
    return baseline


@pytest.fixture(scope="module", params=["fs", "redis", "s3"])
def store(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoredObjects]:
    """The backend's real store: a directory, a redis-server, a moto bucket."""
    if request.param == "fs":
        yield FsObjects(tmp_path_factory.mktemp("gemma-fs"))
    elif request.param == "redis":
        server = RedisServer(tmp_path_factory.mktemp("gemma-redis"),
                             ["--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru"])
        server.start()
        try:
            yield RedisObjects(server)
        finally:
            server.stop()
    else:
        endpoint = request.getfixturevalue("moto_endpoint")
        client = s3_client(endpoint)
        bucket = f"kv-gemma-{uuid.uuid4().hex[:12]}"
        client.create_bucket(Bucket=bucket)
        yield S3Objects(endpoint, bucket, client)


@pytest.fixture(scope="module")
def gemma_cold(gemma: Path, store: StoredObjects, e2e_dir: Path) -> dict[str, Any]:
    """Phase 1 on this backend: computes and stores both groups at ``cold``."""
    return run(f"gemma-{store.backend}-cold", gemma, [store.tier("cold")], e2e_dir / "runs")


def test_second_process_served_both_groups(gemma: Path, gemma_baseline: dict[str, Any],
                                           store: StoredObjects, gemma_cold: dict[str, Any],
                                           e2e_dir: Path) -> None:
    assert outputs(gemma_cold) == outputs(gemma_baseline)
    assert all(p["external_hit_tokens"] == 0 for p in gemma_cold["prompts"]), "tier not empty"
    stored = store.groups("cold")
    assert set(stored) == {0, 1}, f"expected objects of both KV cache groups: {stored}"
    assert tier_counters(gemma_cold)["objects_stored"] == sum(stored.values())

    served = store.copy("cold", "served")
    warm = run(f"gemma-{store.backend}-warm", gemma, [store.tier(served)], e2e_dir / "runs")
    assert warm["tier_classes"][store.backend].startswith("kvstore_tiers."), warm
    assert outputs(warm) == outputs(gemma_baseline)
    assert warm["prompts"][0]["local_hit_tokens"] == 0  # a new process: nothing local
    assert warm["prompts"][0]["external_hit_tokens"] > 0
    counters = tier_counters(warm)
    assert counters["objects_loaded"] > 0
    assert counters.get("corrupt_objects", 0) == 0 and counters.get("load_failures", 0) == 0
    print(f"hybrid {store.backend}: stored per group {stored}, loaded "
          f"{counters['objects_loaded']}, tokens from the tier "
          f"{[p['external_hit_tokens'] for p in warm['prompts']]}")


def test_corrupted_tier_never_changes_the_output(gemma: Path, gemma_baseline: dict[str, Any],
                                                 store: StoredObjects,
                                                 gemma_cold: dict[str, Any],
                                                 e2e_dir: Path) -> None:
    damaged = store.copy("cold", "corrupt")
    assert store.corrupt_all(damaged) == sum(store.groups("cold").values()) > 0
    warm = run(f"gemma-{store.backend}-corrupt", gemma, [store.tier(damaged)],
               e2e_dir / "runs")
    assert outputs(warm) == outputs(gemma_baseline)
    assert [p["external_hit_tokens"] for p in warm["prompts"]] == [0] * len(warm["prompts"])
    counters = tier_counters(warm)
    assert counters["corrupt_objects"] > 0 and counters.get("objects_loaded", 0) == 0
