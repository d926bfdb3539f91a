"""Synchronous (boto3) side of the s3 backend: config, client construction,
the startup probe, listing, lifecycle expiry and garbage collection.

Everything here runs rarely (engine startup, an admin command), so it uses
plain boto3; the data path lives in :mod:`kvstore_tiers.backends.s3` on an
aiobotocore event loop. Both clients are built from the same
:class:`S3Config` by :func:`client_kwargs`/:func:`client_config`, so they
reach the same endpoint with the same credentials and TLS settings.

Secrets (``aws_access_key_id``, ``aws_secret_access_key``,
``aws_session_token``) are :class:`pydantic.SecretStr`: they are revealed
only when handed to the client constructor and :func:`scrub` removes them
from every message this module produces.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, SecretStr, model_validator

from kvstore_tiers.backends.base import ObjectInfo
from kvstore_tiers.config import TierConfig, validate_config
from kvstore_tiers.errors import ConfigError

logger = logging.getLogger(__name__)

SUFFIX = ".kvf"
#: Largest body of one PutObject (S3 limit). A KV block frame is far below it
#: (megabytes), so the backend never needs multipart upload.
MAX_SINGLE_PUT = 5 * 1024**3
#: Lifecycle rule id installed by :func:`install_lifecycle` (one per prefix).
LIFECYCLE_RULE_PREFIX = "kvstore-tiers-expiry"


class S3Config(TierConfig):
    """Keys of the s3 tier (``{"type": "s3", "bucket": ..., ...}``)."""

    bucket: str = Field(min_length=3, max_length=63, description="Bucket holding the blocks.")
    prefix: str = Field(
        "", description="Key prefix (e.g. 'prod/'); objects are <prefix><namespace>/...",
    )
    endpoint_url: str | None = Field(
        None, description="S3-compatible endpoint (MinIO, Ceph...); None for AWS.",
    )
    region: str | None = Field(
        None, description="Region; None: from the AWS environment/profile (us-east-1 if none "
        "and an endpoint_url is set).",
    )
    addressing_style: Literal["auto", "virtual", "path"] = Field(
        "auto", description="Bucket addressing; MinIO and most on-prem servers want 'path'.",
    )
    profile: str | None = Field(None, description="AWS shared-config profile name.")
    aws_access_key_id: SecretStr | None = Field(
        None, description="Explicit access key id (default: the standard AWS chain).",
    )
    aws_secret_access_key: SecretStr | None = Field(None, description="Explicit secret key.")
    aws_session_token: SecretStr | None = Field(None, description="Explicit session token.")
    verify_tls: bool = Field(True, description="Verify the endpoint's TLS certificate.")
    ca_bundle: str | None = Field(None, description="PEM CA bundle to verify TLS with.")
    max_concurrency: int = Field(
        64, ge=1, le=4096, description="Requests in flight at once (and connection pool size).",
    )
    connect_timeout_s: float = Field(
        2.0, gt=0, description="TCP/TLS connect timeout; short, so a dead endpoint fails fast.",
    )
    read_timeout_s: float = Field(15.0, gt=0, description="Socket read timeout per request.")
    retry_mode: Literal["standard", "adaptive", "legacy"] = Field(
        "standard", description="botocore retry mode (5xx, SlowDown, timeouts are retried).",
    )
    max_attempts: int = Field(3, ge=1, le=20, description="Attempts per request, retries incl.")
    request_deadline_s: float = Field(
        60.0, gt=0, description="Deadline of one batch of requests (retries included); past "
        "it the batch fails with a transient error.",
    )
    storage_class: str | None = Field(
        None, description="StorageClass of stored objects (STANDARD, INTELLIGENT_TIERING...).",
    )
    sse: Literal["AES256", "aws:kms"] | None = Field(
        None, description="Server-side encryption: AES256 (SSE-S3) or aws:kms (SSE-KMS).",
    )
    sse_kms_key_id: str | None = Field(None, description="KMS key id/ARN for sse='aws:kms'.")
    create_bucket: bool = Field(False, description="Create the bucket at startup if missing.")
    negative_cache_s: float = Field(
        2.0, ge=0, description="Seconds a block found absent by HEAD is remembered as absent "
        "(lookups of it send no request meanwhile); 0 disables.",
    )
    conditional_put: bool = Field(
        True, description="Use If-None-Match: * so an existing object is never rewritten "
        "(falls back to plain PUT if the server does not implement it).",
    )

    @model_validator(mode="after")
    def _check(self) -> S3Config:
        if self.sse_kms_key_id and self.sse != "aws:kms":
            raise ValueError("sse_kms_key_id needs sse='aws:kms'")
        if (self.aws_access_key_id is None) != (self.aws_secret_access_key is None):
            raise ValueError("aws_access_key_id and aws_secret_access_key go together")
        if self.aws_session_token is not None and self.aws_access_key_id is None:
            raise ValueError("aws_session_token needs aws_access_key_id/aws_secret_access_key")
        if self.profile and self.aws_access_key_id is not None:
            raise ValueError("give either 'profile' or explicit keys, not both")
        if self.prefix.startswith("/"):
            raise ValueError("prefix must not start with '/'")
        return self

    @property
    def key_prefix(self) -> str:
        """The prefix with a trailing '/' (or empty)."""
        p = self.prefix
        return p if not p or p.endswith("/") else p + "/"

    @property
    def where(self) -> str:
        """Human description of the endpoint (never a secret)."""
        return self.endpoint_url or f"AWS S3 ({self.region or 'default region'})"


def as_config(config: S3Config | Mapping[str, Any]) -> S3Config:
    """Accept an S3Config or a tier dict (``type`` ignored) and validate it."""
    if isinstance(config, S3Config):
        return config
    values = {k: v for k, v in config.items() if k not in ("type", "module_path", "backpressure")}
    return validate_config(S3Config, "s3", values)


def secrets_of(config: S3Config) -> list[str]:
    """The secret values of ``config`` (to scrub from messages)."""
    out = []
    for s in (config.aws_access_key_id, config.aws_secret_access_key, config.aws_session_token):
        if s is not None and s.get_secret_value():
            out.append(s.get_secret_value())
    return out


def scrub(text: str, config: S3Config) -> str:
    """``text`` with every configured secret replaced by ``***``."""
    for secret in secrets_of(config):
        text = text.replace(secret, "***")
    return text


def client_kwargs(config: S3Config) -> dict[str, Any]:
    """Keyword arguments of ``session.create_client("s3", ...)`` (boto3 and aiobotocore)."""
    kw: dict[str, Any] = {"endpoint_url": config.endpoint_url}
    region = config.region or ("us-east-1" if config.endpoint_url else None)
    if region:
        kw["region_name"] = region
    if config.aws_access_key_id is not None and config.aws_secret_access_key is not None:
        kw["aws_access_key_id"] = config.aws_access_key_id.get_secret_value()
        kw["aws_secret_access_key"] = config.aws_secret_access_key.get_secret_value()
        if config.aws_session_token is not None:
            kw["aws_session_token"] = config.aws_session_token.get_secret_value()
    if config.ca_bundle:
        kw["verify"] = config.ca_bundle
    elif not config.verify_tls:
        kw["verify"] = False
    return kw


def client_config(
    config: S3Config, *, max_attempts: int | None = None, pool: int | None = None
) -> dict[str, Any]:
    """Keyword arguments of botocore's ``Config``/aiobotocore's ``AioConfig``."""
    return {
        "connect_timeout": config.connect_timeout_s,
        "read_timeout": config.read_timeout_s,
        "retries": {"mode": config.retry_mode,
                    "max_attempts": max_attempts or config.max_attempts},
        "max_pool_connections": pool or config.max_concurrency,
        "s3": {"addressing_style": config.addressing_style},
        # The frame carries a CRC-32C checksum of the raw row and a length that
        # the core verifies on every load; CRC32 trailers on top of it only
        # cost CPU and break some S3-compatible servers.
        "request_checksum_calculation": "when_required",
        "response_checksum_validation": "when_required",
        "user_agent_extra": "kvstore-tiers",
    }


def make_sync_client(config: S3Config, *, max_attempts: int | None = None) -> Any:
    """A boto3 S3 client for ``config`` (admin paths). Raises ConfigError on a bad profile."""
    import boto3
    from botocore.config import Config
    from botocore.exceptions import ProfileNotFound

    try:
        session = boto3.session.Session(profile_name=config.profile)
    except ProfileNotFound:
        raise ConfigError(
            f"s3 tier: key 'profile': AWS profile {config.profile!r} not found"
        ) from None
    return session.client(
        "s3", config=Config(**client_config(config, max_attempts=max_attempts, pool=4)),
        **client_kwargs(config),
    )


def error_code(exc: BaseException) -> tuple[str, int]:
    """(S3 error code, HTTP status) of a botocore ClientError ('', 0 otherwise)."""
    resp = getattr(exc, "response", None)
    if not isinstance(resp, dict):
        return "", 0
    code = str(resp.get("Error", {}).get("Code", ""))
    status = int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code, status


def put_extra_args(config: S3Config) -> dict[str, Any]:
    """PutObject arguments from the config (storage class, server-side encryption)."""
    args: dict[str, Any] = {}
    if config.storage_class:
        args["StorageClass"] = config.storage_class
    if config.sse:
        args["ServerSideEncryption"] = config.sse
        if config.sse_kms_key_id:
            args["SSEKMSKeyId"] = config.sse_kms_key_id
    return args


_CREDENTIAL_CODES = {
    "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken",
    "TokenRefreshRequired", "InvalidClientTokenId", "AuthorizationHeaderMalformed",
}


@dataclass(frozen=True)
class ProbeResult:
    """What the startup probe learned about the server."""

    conditional_put: bool
    bucket_created: bool


def probe(config: S3Config, namespace_name: str | None = None,
          run_config: dict[str, Any] | None = None) -> ProbeResult:
    """Check endpoint, credentials, bucket and write access; learn If-None-Match support.

    Requests: HeadBucket (+ ListObjectsV2 to name a 403, + CreateBucket if
    allowed), two conditional PUTs and a DELETE of a probe object under the
    prefix, and (with ``namespace_name``) one PUT of the namespace's
    ``config.json`` so an administrator can tell what each namespace holds.

    Raises ConfigError whose message says which of endpoint, credentials,
    bucket or permission is wrong, without any secret in it.
    """
    from botocore.exceptions import (
        BotoCoreError,
        ClientError,
        EndpointConnectionError,
        NoCredentialsError,
        SSLError,
    )

    where = config.where
    client = make_sync_client(config, max_attempts=2)
    bucket = config.bucket

    def fail(msg: str) -> ConfigError:
        return ConfigError(scrub(f"s3 tier: {msg}", config))

    created = False
    try:
        try:
            client.head_bucket(Bucket=bucket)
        except ClientError as exc:
            code, status = error_code(exc)
            if status == 404 or code in ("NoSuchBucket", "404"):
                if not config.create_bucket:
                    raise fail(f"bucket {bucket!r} does not exist at {where} "
                               "(create it, or set create_bucket: true)") from None
                kw: dict[str, Any] = {"Bucket": bucket}
                region = client.meta.region_name
                if region and region != "us-east-1":
                    kw["CreateBucketConfiguration"] = {"LocationConstraint": region}
                client.create_bucket(**kw)
                created = True
                logger.info("s3 tier: created bucket %r at %s", bucket, where)
            elif status in (400, 403):
                # HEAD carries no error body: ask again with a request that does.
                try:
                    client.list_objects_v2(Bucket=bucket, Prefix=config.key_prefix, MaxKeys=1)
                except ClientError as exc2:
                    code2, _ = error_code(exc2)
                    if code2 in _CREDENTIAL_CODES:
                        raise fail(f"credentials rejected by {where} ({code2})") from None
                    raise fail(f"access to bucket {bucket!r} at {where} denied "
                               f"({code2 or status}); check the bucket policy/IAM role") from None
            else:
                raise fail(f"cannot use bucket {bucket!r} at {where}: {code or status}") from None

        probe_key = f"{config.key_prefix}.kvstore-probe/{uuid.uuid4().hex}"
        extra = put_extra_args(config)
        conditional = config.conditional_put
        try:
            client.put_object(Bucket=bucket, Key=probe_key, Body=b"probe", **extra)
            if conditional:
                try:
                    client.put_object(Bucket=bucket, Key=probe_key, Body=b"probe",
                                      IfNoneMatch="*", **extra)
                    # Accepted although the object exists: the header is ignored.
                    conditional = False
                except ClientError as exc:
                    code, status = error_code(exc)
                    if status not in (412, 409):
                        conditional = False
            client.delete_object(Bucket=bucket, Key=probe_key)
        except ClientError as exc:
            code, status = error_code(exc)
            if code in _CREDENTIAL_CODES:
                raise fail(f"credentials rejected by {where} ({code})") from None
            raise fail(f"cannot write under s3://{bucket}/{config.key_prefix} at {where} "
                       f"({code or status})") from None
        if conditional != config.conditional_put:
            logger.info("s3 tier: %s ignores or rejects If-None-Match; using plain PUT", where)
        if namespace_name and run_config is not None:
            import json

            client.put_object(
                Bucket=bucket, Key=f"{config.key_prefix}{namespace_name}/config.json",
                Body=json.dumps(run_config, indent=2, sort_keys=True).encode(),
                ContentType="application/json", **extra,
            )
        return ProbeResult(conditional_put=conditional, bucket_created=created)
    except ConfigError:
        raise
    except NoCredentialsError:
        raise fail("no AWS credentials found (set aws_access_key_id/aws_secret_access_key, "
                   "'profile', or the standard AWS environment variables/role)") from None
    except SSLError as exc:
        raise fail(f"TLS verification failed for {where} ({exc}); set ca_bundle, or "
                   "verify_tls: false for a test server") from None
    except EndpointConnectionError:
        raise fail(f"cannot reach endpoint {where} (connection refused or unresolvable)") \
            from None
    except BotoCoreError as exc:
        raise fail(f"cannot reach endpoint {where} ({type(exc).__name__}: {exc})") from None
    except ClientError as exc:
        code, status = error_code(exc)
        if code in _CREDENTIAL_CODES:
            raise fail(f"credentials rejected by {where} ({code})") from None
        raise fail(f"bucket {bucket!r} at {where}: {code or status}") from None
    finally:
        client.close()


def iter_objects(config: S3Config, prefix: str = "", client: Any = None) -> Iterator[ObjectInfo]:
    """Every block object under ``<config.prefix><prefix>`` (names without config.prefix)."""
    client = client or make_sync_client(config)
    base = config.key_prefix
    paginator = client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=config.bucket, Prefix=base + prefix):
        for obj in page.get("Contents", ()):
            key: str = obj["Key"]
            if not key.endswith(SUFFIX):
                continue
            yield ObjectInfo(key[len(base):], int(obj["Size"]),
                             obj["LastModified"].timestamp())


def install_lifecycle(config: S3Config | Mapping[str, Any], days: int) -> dict[str, Any]:
    """Install (or replace) an S3 lifecycle rule expiring this prefix's objects.

    Objects under ``prefix`` expire ``days`` days after they were written
    (S3 counts from creation; a load does not extend it). Incomplete
    multipart uploads under the prefix are aborted after one day. Other
    rules of the bucket are kept; our rule is identified by its id
    ``kvstore-tiers-expiry:<prefix>``. Returns the rule installed.
    Needs ``s3:GetLifecycleConfiguration`` and ``s3:PutLifecycleConfiguration``.
    """
    from botocore.exceptions import ClientError

    cfg = as_config(config)
    if days < 1:
        raise ConfigError("s3 lifecycle: days must be >= 1")
    client = make_sync_client(cfg)
    rule_id = f"{LIFECYCLE_RULE_PREFIX}:{cfg.key_prefix or '*'}"[:255]
    try:
        rules = client.get_bucket_lifecycle_configuration(Bucket=cfg.bucket).get("Rules", [])
    except ClientError as exc:
        code, _ = error_code(exc)
        if code != "NoSuchLifecycleConfiguration":
            raise
        rules = []
    rule = {
        "ID": rule_id,
        "Filter": {"Prefix": cfg.key_prefix},
        "Status": "Enabled",
        "Expiration": {"Days": int(days)},
        "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 1},
    }
    rules = [r for r in rules if r.get("ID") != rule_id] + [rule]
    client.put_bucket_lifecycle_configuration(
        Bucket=cfg.bucket, LifecycleConfiguration={"Rules": rules}
    )
    return rule


@dataclass(frozen=True)
class GcResult:
    """Outcome of :func:`gc`."""

    scanned_objects: int
    scanned_bytes: int
    deleted_objects: int
    deleted_bytes: int

    @property
    def remaining_bytes(self) -> int:
        return self.scanned_bytes - self.deleted_bytes


def gc(
    config: S3Config | Mapping[str, Any], *, max_age_s: float | None = None,
    max_bytes: int | None = None, namespace: str | None = None, dry_run: bool = False,
    now: float | None = None,
) -> GcResult:
    """Delete block objects older than ``max_age_s`` and then the oldest until
    at most ``max_bytes`` remain, under the prefix (or one ``namespace`` of it).

    Age is the object's LastModified (write time): S3 keeps no access time,
    so this is FIFO, not LRU. Safe while engines run: a deleted block is a
    miss (the core recomputes it), never wrong data. Deletes in batches of
    1000 (DeleteObjects). ``dry_run`` only counts.
    """
    cfg = as_config(config)
    client = make_sync_client(cfg)
    now = time.time() if now is None else now
    objs = list(iter_objects(cfg, f"{namespace}/" if namespace else "", client=client))
    total = sum(o.size for o in objs)
    doomed: list[ObjectInfo] = []
    keep: list[ObjectInfo] = []
    for o in objs:
        (doomed if max_age_s is not None and now - o.mtime > max_age_s else keep).append(o)
    if max_bytes is not None:
        remaining = sum(o.size for o in keep)
        keep.sort(key=lambda o: o.mtime)
        i = 0
        while remaining > max_bytes and i < len(keep):
            doomed.append(keep[i])
            remaining -= keep[i].size
            i += 1
    if not dry_run:
        base = cfg.key_prefix
        for start in range(0, len(doomed), 1000):
            batch = doomed[start : start + 1000]
            client.delete_objects(
                Bucket=cfg.bucket,
                Delete={"Objects": [{"Key": base + o.name} for o in batch], "Quiet": True},
            )
    return GcResult(len(objs), total, len(doomed), sum(o.size for o in doomed))
