"""A bad config fails at startup with a message naming the key."""

from __future__ import annotations

import pytest

from kvstore_tiers.backends.fs import FsConfig
from kvstore_tiers.config import validate_config
from kvstore_tiers.errors import ConfigError


def test_unknown_key_is_named_with_the_accepted_ones() -> None:
    with pytest.raises(ConfigError) as err:
        validate_config(FsConfig, "fs", {"root_dir": "/tmp/x", "max_byts": 10})
    msg = str(err.value)
    assert "'max_byts'" in msg and "unknown key" in msg and "max_bytes" in msg


def test_bad_value_and_missing_key_are_named() -> None:
    with pytest.raises(ConfigError, match="'compression'"):
        validate_config(FsConfig, "fs", {"root_dir": "/tmp/x", "compression": "lz4"})
    with pytest.raises(ConfigError, match="'root_dir'"):
        validate_config(FsConfig, "fs", {})
    with pytest.raises(ConfigError, match="'n_read_threads'"):
        validate_config(FsConfig, "fs", {"root_dir": "/tmp/x", "n_read_threads": 0})
    with pytest.raises(ConfigError, match="'store_poll_ms'"):
        validate_config(FsConfig, "fs", {"root_dir": "/tmp/x", "store_poll_ms": 0})
    with pytest.raises(ConfigError, match="'store_linger_s'"):
        validate_config(FsConfig, "fs", {"root_dir": "/tmp/x", "store_linger_s": -1})


def test_stock_fs_keys_are_accepted() -> None:
    cfg = validate_config(FsConfig, "fs", {
        "root_dir": "/tmp/x", "n_read_threads": 4, "n_write_threads": 2,
        "enable_kv_events": True, "locality": "LOCAL",
    })
    assert cfg.n_read_threads == 4 and cfg.locality == "LOCAL"


def test_lower_case_locality_is_rejected() -> None:
    with pytest.raises(ConfigError, match="'locality'"):
        validate_config(FsConfig, "fs", {"root_dir": "/tmp/x", "locality": "local"})
