"""Shared fixtures: the real KV samples, vLLM harnesses that clean up after themselves,
and the real servers of tests/servers.py (redis-server, Redis Cluster, moto S3, Ceph RGW)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore_tiers.tools import samples
from tests.servers import (  # noqa: F401  (fixtures for every test folder)
    _fake_aws_env,
    bucket,
    deselect_other_server,
    moto_endpoint,
    proxy,
    redis_cluster,
    redis_server,
    redis_server_factory,
    rgw_endpoint,
    rgw_server,
    s3,
    s3_endpoint,
    tier_config,
)

REPO = Path(__file__).resolve().parent.parent
#: The real KV samples: $KVSTORE_KV_SAMPLES, else ``shared/data/kv-samples`` beside the checkout.
KV_SAMPLES_DIR = samples.from_env() or REPO.parent / "shared/data/kv-samples"


def pytest_report_header() -> str:
    """Which vLLM this run tests against (scripts/test.sh runs 0.32 and 0.33)."""
    try:
        import vllm
    except ImportError:
        return "vllm: not installed"
    return f"vllm {vllm.__version__} from {Path(vllm.__file__).parent}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test marked moto_only/rgw_only runs on that S3 server only."""
    deselect_other_server(config, items)


def load_kv_samples() -> list[tuple[dict[str, Any], np.ndarray]]:
    """[(file entry of the JSON sidecar, blocks as (num_blocks, block_bytes) uint8)]."""
    return samples.load(KV_SAMPLES_DIR)


@pytest.fixture(scope="session")
def kv_samples() -> list[tuple[dict[str, Any], np.ndarray]]:
    if not (KV_SAMPLES_DIR / "kv-samples.json").exists():
        pytest.skip(f"real KV samples not found at {KV_SAMPLES_DIR}")
    return load_kv_samples()


@pytest.fixture
def harness_factory() -> Iterator[Callable[..., Any]]:
    """Build vLLM spec+manager harnesses; every one is shut down at test end."""
    from kvstore_tiers.admin.harness import build_harness

    made: list[Any] = []

    def make(tiers: list[dict[str, Any]], **kwargs: Any) -> Any:
        h = build_harness(tiers, **kwargs)
        made.append(h)
        return h

    yield make
    for h in made:
        h.shutdown()


def rows_like(n: int, row_bytes: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, row_bytes), dtype=np.uint8)
