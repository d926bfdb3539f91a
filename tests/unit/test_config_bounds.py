"""Every key has bounds a real deployment could use, and a rejection names the key.

Configs go through vLLM's own ``SecondaryTierFactory`` (the harness builds the
offloading spec exactly as an engine does); each is refused while validating,
before any connection, file or thread is made.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import pytest

from kvstore_tiers.admin.harness import build_harness
from kvstore_tiers.backends.redis import RedisConfig
from kvstore_tiers.backends.s3.config import S3Config
from kvstore_tiers.config import validate_config
from kvstore_tiers.errors import ConfigError

S3 = {"type": "s3", "bucket": "kv-bucket", "endpoint_url": "http://127.0.0.1:9"}
REDIS = {"type": "redis", "url": "redis://127.0.0.1:9/0"}

BAD: list[tuple[dict[str, Any], str]] = [
    ({"type": "fs", "root_dir": ""}, "root_dir"),
    ({"type": "fs", "root_dir": "   "}, "root_dir"),
    ({"type": "fs", "root_dir": "/tmp/kv", "max_bytes": 10**30}, "max_bytes"),
    ({"type": "fs", "root_dir": "/tmp/kv", "min_free_bytes": 10**30}, "min_free_bytes"),
    ({"type": "fs", "root_dir": "/tmp/kv", "encryption_key_env": ""}, "encryption_key_env"),
    ({"type": "fs", "root_dir": "/tmp/kv", "encryption_key_file": ""}, "encryption_key_file"),
    ({"type": "fs", "root_dir": "/tmp/kv", "load_timeout_s": 1e300}, "load_timeout_s"),
    ({"type": "fs", "root_dir": "/tmp/kv", "breaker_cooldown_s": 1e300}, "breaker_cooldown_s"),
    ({"type": "fs", "root_dir": "/tmp/kv", "max_queued_chunks": 10**18}, "max_queued_chunks"),
    ({"type": "fs", "root_dir": "/tmp/kv", "presence_capacity": 10**18}, "presence_capacity"),
    ({"type": "fs", "root_dir": "/tmp/kv", "store_linger_s": 1e300}, "store_linger_s"),
    ({"type": "fs", "root_dir": "/tmp/kv", "failure_threshold": 10**18}, "failure_threshold"),
    ({**REDIS, "max_connections": 10**18}, "max_connections"),
    ({**REDIS, "ttl_s": 10**18}, "ttl_s"),
    ({**REDIS, "socket_timeout_s": 1e300}, "socket_timeout_s"),
    ({**REDIS, "connect_timeout_s": 1e300}, "connect_timeout_s"),
    ({**REDIS, "url": ""}, "url"),
    ({**REDIS, "url": "redis://:99999"}, "url"),
    ({**REDIS, "url": "redis://127.0.0.1:99999/0"}, "url"),
    ({**REDIS, "encryption_key_env": ""}, "encryption_key_env"),
    ({"type": "redis", "nodes": []}, "nodes"),
    ({"type": "redis", "nodes": ["127.0.0.1"]}, "nodes"),
    ({"type": "redis", "nodes": ["127.0.0.1:0"]}, "nodes"),
    ({**S3, "request_deadline_s": 1e300}, "request_deadline_s"),
    ({**S3, "connect_timeout_s": 1e300}, "connect_timeout_s"),
    ({**S3, "read_timeout_s": 1e300}, "read_timeout_s"),
    ({**S3, "negative_cache_s": 1e300}, "negative_cache_s"),
    ({**S3, "ca_bundle": "/nonexistent/ca.pem"}, "ca_bundle"),
    ({**S3, "endpoint_url": ""}, "endpoint_url"),
    ({**S3, "endpoint_url": "0"}, "endpoint_url"),
    ({**S3, "endpoint_url": "-1"}, "endpoint_url"),
    ({**S3, "endpoint_url": "http://"}, "endpoint_url"),
    ({**S3, "endpoint_url": "http://127.0.0.1:70000"}, "endpoint_url"),
    ({**S3, "region": "not a region!"}, "region"),
    ({**S3, "region": ""}, "region"),
    ({**S3, "encryption_key_file": " "}, "encryption_key_file"),
    ({**S3, "region": "0"}, "region"),  # all digits: botocore's InvalidRegionError before
    ({**S3, "region": "-eu"}, "region"),
    ({**S3, "storage_class": "-1"}, "storage_class"),
    ({**S3, "storage_class": "0"}, "storage_class"),
    ({**S3, "storage_class": "S" * 5000}, "storage_class"),
    ({"type": "s3", "bucket": "kv-bucket", "storage_class": "COLD"}, "storage_class"),  # AWS
    ({**REDIS, "tls_ca_file": "/etc/ca.pem"}, "tls_ca_file"),  # redis://, not rediss://
    ({**REDIS, "tls_cert_file": "/etc/c.pem", "tls_key_file": "/etc/k.pem"}, "tls_cert_file"),
    ({**REDIS, "tls_cert_file": "/etc/c.pem", "tls_key_file": "/etc/k.pem"}, "tls_key_file"),
    ({**REDIS, "url": "rediss://127.0.0.1:9/0", "tls_ca_file": ""}, "tls_ca_file"),
    ({**REDIS, "url": "rediss://127.0.0.1:9/0", "tls_cert_file": " ",
      "tls_key_file": "/etc/k.pem"}, "tls_cert_file"),
]


@pytest.fixture(scope="module", autouse=True)
def _vllm_imported() -> None:
    """Import vLLM and its factories once, so each case times only its own validation."""
    with pytest.raises(ConfigError):
        build_harness([{"type": "fs"}], num_chunks=4, chunk_bytes=4096)


@pytest.mark.parametrize("tier,key", BAD, ids=[f"{t['type']}-{k}-{i}" for i, (t, k) in
                                                 enumerate(BAD)])
def test_out_of_bounds_value_fails_startup_naming_the_key(tier: dict[str, Any], key: str) -> None:
    start = time.monotonic()
    with pytest.raises(ConfigError) as err:
        build_harness([tier], num_chunks=4, chunk_bytes=4096)
    assert f"'{key}'" in str(err.value), str(err.value)
    assert time.monotonic() - start < 10  # refused, not tried (max_connections hung before)


def test_fs_floor_the_filesystem_can_never_hold_fails_at_open_naming_the_key(
        tmp_path: Any) -> None:
    """A floor of the filesystem's size or more (1e18 reads as an int) would let
    the tier start and fail every store; one leaving a block of room starts."""
    root = tmp_path / "kv"
    root.mkdir()
    st = os.statvfs(root)
    size = (st.f_blocks - (st.f_bfree - st.f_bavail)) * st.f_frsize
    for floor in (1e18, size):
        with pytest.raises(ConfigError) as err:
            build_harness([{"type": "fs", "root_dir": str(root), "min_free_bytes": floor}],
                          num_chunks=4, chunk_bytes=4096)
        assert "'min_free_bytes'" in str(err.value), str(err.value)
    build_harness([{"type": "fs", "root_dir": str(root), "min_free_bytes": size // 2}],
                  num_chunks=4, chunk_bytes=4096).shutdown()


def test_fs_cap_without_room_for_one_block_fails_at_open_naming_the_key(
        tmp_path: Any) -> None:
    """The namespace directory's own bytes count in max_bytes: a cap that leaves
    less than one filesystem block beside them can never take a store."""
    from kvstore_tiers.backends.fs.capacity import CapacityController
    from kvstore_tiers.backends.fs.config import FsConfig

    ns_dir = tmp_path / "ns"
    ns_dir.mkdir()

    def started(max_bytes: int) -> CapacityController:
        cap = CapacityController(ns_dir, FsConfig(root_dir=str(tmp_path), max_bytes=max_bytes),
                                 lambda paths: None)
        cap.start()
        return cap

    started(1 << 40).stop()  # the first count comes before the ledger file has a block
    probe = started(1 << 40)
    overhead, block = probe.overhead, probe.block
    probe.stop()
    with pytest.raises(ConfigError) as err:
        started(overhead + block - 1)
    assert "'max_bytes'" in str(err.value), str(err.value)
    started(overhead + block).stop()


def test_deployment_sized_values_are_accepted(tmp_path: Any) -> None:
    validate_config(RedisConfig, "redis", {
        "url": "rediss://cache.internal:6380/2", "ttl_s": 30 * 86400, "max_connections": 2048,
        "socket_timeout_s": 120, "connect_timeout_s": 30})
    validate_config(RedisConfig, "redis", {"nodes": ["10.0.0.1:7000", "[::1]:7001"]})
    bundle = tmp_path / "ca.pem"
    bundle.write_text("-----BEGIN CERTIFICATE-----\n")
    validate_config(S3Config, "s3", {
        "bucket": "kv-bucket", "endpoint_url": "https://s3.example.com:9000",
        "region": "eu-central-1", "ca_bundle": str(bundle), "request_deadline_s": 120,
        "read_timeout_s": 60, "connect_timeout_s": 10, "storage_class": "STANDARD_IA"})
    validate_config(S3Config, "s3", {"bucket": "kv-bucket", "storage_class": "GLACIER_IR"})
    validate_config(S3Config, "s3", {  # a Ceph RGW placement's own class
        "bucket": "kv-bucket", "endpoint_url": "http://ceph:8080", "storage_class": "COLD"})
    validate_config(RedisConfig, "redis", {
        "url": "rediss://cache.internal:6380/2", "tls_ca_file": str(bundle),
        "tls_cert_file": str(bundle), "tls_key_file": str(bundle)})
    # A floor the machine's disk can hold: one of its size or more fails at open.
    floor = min(10 << 30, shutil.disk_usage(tmp_path).total // 4)
    h = build_harness([{"type": "fs", "root_dir": str(tmp_path / "kv"),
                        "max_bytes": 500 << 30, "min_free_bytes": floor,
                        "load_timeout_s": 30, "presence_capacity": 50_000_000}],
                      num_chunks=4, chunk_bytes=4096)
    h.shutdown()
