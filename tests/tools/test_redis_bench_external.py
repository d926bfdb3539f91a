"""``bench --redis-url``: the user's own Redis is measured, left as it was, and its
password appears nowhere in the result."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator

import pytest

redis = pytest.importorskip("redis")
pytest.importorskip("vllm")

from kvstore_tiers.tools.bench import redis_bench  # noqa: E402
from kvstore_tiers.tools.bench.runner import BenchPlan, describe  # noqa: E402

SECRET = "bench-pw-4f1c9d"


@pytest.fixture
def users_redis(tmp_path) -> Iterator[int]:
    """A password-protected redis-server holding one key of the user's."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server not installed")
    port = redis_bench._free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path),
                             "--requirepass", SECRET],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port, password=SECRET)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        client.set("user:keep", b"mine")
        yield port
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=10)


def test_own_server_measured_untouched_and_secret_free(users_redis: int) -> None:
    url = f"redis://:{SECRET}@127.0.0.1:{users_redis}/0"
    result = redis_bench.run(block_bytes=64 << 10, blocks=8, rounds=2, threads=2, batch=4,
                             url=url)
    b = result["bandwidth"]
    assert b["baseline"] == "redis-py pipelined loop"
    assert b["server"] == f"127.0.0.1:{users_redis}/0"
    assert b["tier_set_MiBps"] > 0 and b["raw_client_get_MiBps"] > 0
    assert len(b["set_ratios_raw"]) == 2 and b["get_ratio_raw"] > 0
    for who in ("tier_set", "tier_get", "tier_get_transfer", "raw_client_set", "raw_client_get"):
        assert b[f"{who}_cpu_s_per_gb"] > 0, who  # this process's CPU per GB moved
    assert "memory" not in result  # a used_memory delta means nothing on a shared server
    assert SECRET not in json.dumps(result)
    client = redis.Redis(port=users_redis, password=SECRET)
    try:
        assert client.keys("*") == [b"user:keep"]  # ours deleted, the user's kept
        assert client.get("user:keep") == b"mine"
    finally:
        client.close()
    plan = BenchPlan(tiers=("redis",), redis_url=url)
    assert SECRET not in json.dumps(describe(plan)) and SECRET not in repr(plan)
