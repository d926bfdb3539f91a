"""docker-compose.yml and examples/s3-minio.json agree (no Docker engine needed)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from kvstore_tiers.backends.s3.config import as_config

REPO = Path(__file__).resolve().parents[3]


def test_compose_has_minio_with_bucket_init_and_redis() -> None:
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"minio", "minio-init", "redis"} <= set(services)
    # Published on the loopback address only: never on every interface of the host.
    assert "127.0.0.1:9000:9000" in services["minio"]["ports"]
    assert "127.0.0.1:6379:6379" in services["redis"]["ports"]
    for service in services.values():
        assert all(str(p).startswith("127.0.0.1:") for p in service.get("ports", []))
    init = services["minio-init"]
    assert init["image"].startswith("minio/mc")
    assert init["depends_on"]["minio"]["condition"] == "service_healthy"
    assert "healthcheck" in services["minio"]
    assert "mc mb --ignore-existing local/kv-cache" in init["entrypoint"]

    # The example tier config points at that MinIO, with its credentials and bucket.
    cfg = as_config(json.loads((REPO / "examples/s3-minio.json").read_text()))
    env = services["minio"]["environment"]
    assert cfg.bucket == "kv-cache"
    assert cfg.endpoint_url == "http://localhost:9000"
    assert cfg.addressing_style == "path"
    assert cfg.aws_access_key_id is not None and cfg.aws_secret_access_key is not None
    assert cfg.aws_access_key_id.get_secret_value() == env["MINIO_ROOT_USER"]
    assert cfg.aws_secret_access_key.get_secret_value() == env["MINIO_ROOT_PASSWORD"]
