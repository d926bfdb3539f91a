"""stats / verify / gc / check against a real redis-server and a moto S3 server."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..servers import RedisServer, free_port
from .conftest import invoke, populate


def _redis_tier(server: RedisServer) -> dict[str, Any]:
    return {"type": "redis", "url": server.url, "compression": "none"}


def test_redis_stats_verify_gc(redis_server: RedisServer,
                               harness_factory: Callable[..., Any]) -> None:
    tier = _redis_tier(redis_server)
    populate(harness_factory, tier)
    cfg = json.dumps(tier)
    st = json.loads(invoke("stats", "--config", cfg, "--json").stdout)[0]
    assert st["objects"] == 8
    ((_ns, info),) = st["namespaces"].items()
    assert info["objects"] == 8 and info["model"] == "?"  # redis stores no run config

    client = redis_server.client()
    keys = sorted(k.decode() for k in client.scan_iter("kvstore:*.kvf"))
    assert len(keys) == 8
    value = bytearray(client.get(keys[0]))
    value[-5] ^= 0xFF
    client.set(keys[0], bytes(value))
    bad = invoke("verify", "--config", cfg, "--delete")
    assert bad.exit_code == 1 and "checksum mismatch" in bad.output
    assert client.exists(keys[0]) == 0
    assert invoke("verify", "--config", cfg).exit_code == 0

    # Age comes from the frame's created_ms (bytes 56..64): make two frames 2 days old.
    old_ms = int((time.time() - 2 * 86400) * 1000).to_bytes(8, "little")
    for k in keys[1:3]:
        client.setrange(k, 56, old_ms)
    out = invoke("gc", "--config", cfg, "--max-age", "1d", "--json")
    assert out.exit_code == 0, out.output
    rep = json.loads(out.stdout)[0]
    assert rep["deleted_objects"] == 2 and rep["batched_deletes"]  # an UNLINK pipeline
    assert client.exists(*keys[1:3]) == 0
    size = client.strlen(keys[3])
    out = invoke("gc", "--redis", redis_server.url, "--max-bytes", str(2 * size), "--json")
    assert json.loads(out.stdout)[0]["deleted_objects"] == 3
    assert len(list(client.scan_iter("kvstore:*.kvf"))) == 2


def test_redis_check_ok_and_wrong_endpoint(redis_server: RedisServer) -> None:
    ok = invoke("check", "--redis", redis_server.url, "--json")
    assert ok.exit_code == 0, ok.output
    rep = json.loads(ok.stdout)[0]
    assert rep["ok"] and rep["codec"] == "kvsplit"  # auto on a remote tier, bf16 KV
    url = f"redis://127.0.0.1:{free_port()}/0"
    bad = invoke("check", "--config", json.dumps({"type": "redis", "url": url,
                                                  "connect_timeout_s": 0.5, "retries": 0}))
    assert bad.exit_code == 1
    assert "cannot connect" in bad.output and url in bad.output


def test_s3_stats_verify_gc(tier_config: Callable[..., dict[str, Any]], s3: Any, bucket: str,
                            harness_factory: Callable[..., Any]) -> None:
    tier = tier_config(compression="zstd")
    populate(harness_factory, tier)
    cfg = json.dumps(tier)
    st = json.loads(invoke("stats", "--config", cfg, "--json").stdout)[0]
    assert st["objects"] == 8
    ((_ns, info),) = st["namespaces"].items()
    assert info["model"] == "org/model" and info["dtype"] == "bfloat16"  # from config.json

    keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]
                  if o["Key"].endswith(".kvf"))
    body = bytearray(s3.get_object(Bucket=bucket, Key=keys[0])["Body"].read())
    body[-3] ^= 0xFF
    s3.put_object(Bucket=bucket, Key=keys[0], Body=bytes(body))
    bad = invoke("verify", "--config", cfg, "--json")
    assert bad.exit_code == 1
    rep = json.loads(bad.stdout)[0]
    # random rows do not compress: the writer stored them raw (codec none in the frame)
    assert len(rep["corrupt"]) == 1 and rep["ok"] == 7 and rep["codecs"] == {"none": 7}
    assert invoke("verify", "--config", cfg, "--delete").exit_code == 1
    assert invoke("verify", "--config", cfg).exit_code == 0

    out = invoke("gc", "--config", cfg, "--max-bytes", "1", "--json")
    rep = json.loads(out.stdout)[0]
    assert rep["deleted_objects"] == 7 and rep["batched_deletes"]  # DeleteObjects
    left = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert not [k for k in left if k.endswith(".kvf")]
    assert any(k.endswith("/config.json") for k in left)  # the run config stays


def test_s3_check_ok_and_wrong_endpoint(tier_config: Callable[..., dict[str, Any]]) -> None:
    ok = invoke("check", "--config", json.dumps(tier_config()), "--json")
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.stdout)[0]["ok"]
    endpoint = f"http://127.0.0.1:{free_port()}"
    bad = invoke("check", "--config", json.dumps(tier_config(endpoint_url=endpoint,
                                                             max_attempts=1)))
    assert bad.exit_code == 1
    assert endpoint in bad.output
    assert "fakeSecret" not in bad.output


def test_check_prints_its_report_and_the_store_s_warnings_once(redis_server_factory,
                                                               tmp_path: Path) -> None:
    """As a person runs it (a new process): no line of vLLM's start-up, nothing about the
    placeholder model of the check's engine, a Redis without maxmemory said once."""
    srv = redis_server_factory([])
    proc = subprocess.run([sys.executable, "-c", "from kvstore_tiers.cli import main; main()",
                           "check", "--redis", srv.url], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK redis" in proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no maxmemory limit" in lines[0], proc.stderr
