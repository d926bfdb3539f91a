"""The redis tier: KV blocks as Redis strings on a server or a Redis Cluster.

Modules: :mod:`.config` (the tier's keys), :mod:`.client` (credentials,
connection, start-up probe, error mapping, per-node pipelines),
:mod:`.backend` (:class:`RedisBackend`, the store and load paths) and
:mod:`.fastio` (the zero-copy single-server path).
"""

from kvstore_tiers.backends.redis.backend import RedisBackend
from kvstore_tiers.backends.redis.client import classify_redis
from kvstore_tiers.backends.redis.config import RedisConfig, redact_url

__all__ = ["RedisBackend", "RedisConfig", "classify_redis", "redact_url"]
