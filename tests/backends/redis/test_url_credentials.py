"""The credentials taken out of a redis URL leave a URL redis-py accepts."""

from __future__ import annotations

import pytest
import redis

from kvstore_tiers.backends.redis.client import split_credentials


@pytest.mark.parametrize(("url", "bare", "user", "pwd"), [
    ("redis://u:pw@127.0.0.1:6379/0", "redis://127.0.0.1:6379/0", "u", "pw"),
    ("rediss://:pw@host:6380/1", "rediss://host:6380/1", None, "pw"),
    ("unix://:pw@/tmp/redis.sock?db=2", "unix:///tmp/redis.sock?db=2", None, "pw"),
    ("unix://u:pw@/tmp/redis.sock", "unix:///tmp/redis.sock", "u", "pw"),
    ("unix:///tmp/redis.sock", "unix:///tmp/redis.sock", None, None),
])
def test_split_credentials(url: str, bare: str, user: str | None, pwd: str | None) -> None:
    assert split_credentials(url) == (bare, user, pwd)
    redis.Redis.from_url(bare)  # redis-py parses what we hand it (no connection made)
