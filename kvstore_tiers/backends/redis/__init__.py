"""The redis tier: KV blocks as Redis strings on a server or a Redis Cluster.

Modules: :mod:`.config` (the tier's keys), :mod:`.client` (credentials,
connection, start-up probe, error mapping, per-node pipelines),
:mod:`.backend` (:class:`RedisBackend`, the store and load paths) and
:mod:`.fastio` (the zero-copy single-server path).

The names below are imported on first use (PEP 562): :mod:`.config` needs no
``redis`` package, so code that only reads a redis tier's keys (``kvstore-tiers
config`` moving a password out of a config) works where the ``redis`` extra is
not installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstore_tiers.backends.redis.backend import RedisBackend
    from kvstore_tiers.backends.redis.client import classify_redis
    from kvstore_tiers.backends.redis.config import RedisConfig
    from kvstore_tiers.redact import redact_url

__all__ = ["RedisBackend", "RedisConfig", "classify_redis", "redact_url"]

_HOME = {"RedisBackend": "kvstore_tiers.backends.redis.backend",
         "RedisConfig": "kvstore_tiers.backends.redis.config",
         "classify_redis": "kvstore_tiers.backends.redis.client",
         "redact_url": "kvstore_tiers.redact"}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
