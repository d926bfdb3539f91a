"""The backend conformance suite against real redis-servers: a single server on the
fast path, the same on plain redis-py pipelines, and a three-master Redis Cluster."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore_tiers.backends.redis import RedisBackend, RedisConfig
from kvstore_tiers.config import validate_config
from kvstore_tiers.namespace import Namespace
from kvstore_tiers.testing.backend import BackendTests

from ...servers import RedisCluster, RedisServer


def _backend(namespace: Namespace, **values: Any) -> RedisBackend:
    return RedisBackend(validate_config(RedisConfig, "redis", values), namespace)


class TestRedisFastIO(BackendTests):
    """One server, ``fast_io: true`` (zero-copy SET/GET)."""

    fast_io = True

    @pytest.fixture(autouse=True)
    def _server(self, redis_server: RedisServer) -> None:
        self.url = redis_server.url

    def make_backend(self, namespace: Namespace, tmp_path: Path) -> RedisBackend:
        return _backend(namespace, url=self.url, fast_io=self.fast_io)

    def test_the_fast_path_is_the_one_tested(self, backend: RedisBackend) -> None:
        assert (backend._fast is not None) == self.fast_io


class TestRedisPipelines(TestRedisFastIO):
    """One server, ``fast_io: false`` (plain redis-py pipelines)."""

    fast_io = False


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    c = RedisCluster(tmp_path_factory.mktemp("conformance-cluster")).start()
    yield c
    c.stop()


class TestRedisCluster(BackendTests):
    """A three-master Redis Cluster; every test under its own key prefix."""

    @pytest.fixture(autouse=True)
    def _cluster(self, cluster: RedisCluster) -> None:
        self.nodes = cluster.addresses

    def make_backend(self, namespace: Namespace, tmp_path: Path) -> RedisBackend:
        return _backend(namespace, nodes=self.nodes, key_prefix=f"c{uuid.uuid4().hex[:8]}:")
