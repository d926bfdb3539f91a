"""Keys of the s3 tier, and the helpers that keep its secrets out of messages."""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator

from kvstore_tiers.config import TierConfig, url_port, validate_config

SUFFIX = ".kvf"
#: Largest body of one PutObject (S3 limit). A KV block frame is far below it
#: (megabytes), so the backend never needs multipart upload.
MAX_SINGLE_PUT = 5 * 1024**3
#: A storage class of an S3-compatible server's own (a Ceph RGW placement's, e.g. COLD).
_OWN_STORAGE_CLASS = re.compile(r"^[A-Z][A-Z0-9_]{0,63}$")


def _region_problem(region: str) -> str | None:
    """Why botocore would refuse ``region`` (None: it would not, or botocore is
    not installed, when the tier cannot start anyway)."""
    if not region:
        return "must not be empty (leave the key out for the AWS environment's region)"
    try:
        from botocore.exceptions import InvalidRegionError
        from botocore.utils import validate_region_name
    except ImportError:
        return None
    try:
        validate_region_name(region)
    except InvalidRegionError:
        return (f"not a region name (letters, digits and '-', not all digits, at most 63): "
                f"{region[:70]!r}")
    return None


@functools.cache
def storage_classes() -> tuple[str, ...]:
    """The storage classes of botocore's model of the S3 API (empty without botocore
    or without that model, when any name is let through)."""
    try:
        from botocore.exceptions import DataNotFoundError
        from botocore.loaders import create_loader
    except ImportError:
        return ()
    try:
        shapes = create_loader().load_service_model("s3", "service-2")["shapes"]
        return tuple(shapes["StorageClass"]["enum"])
    except (DataNotFoundError, KeyError):
        return ()


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
        None, description="Explicit access key id. Default, and preferred: the standard AWS "
        "chain (vLLM's server logs the config; the tier warns at start-up).",
    )
    aws_secret_access_key: SecretStr | None = Field(None, description="Explicit secret key.")
    aws_session_token: SecretStr | None = Field(None, description="Explicit session token.")
    verify_tls: bool = Field(True, description="Verify the endpoint's TLS certificate.")
    ca_bundle: str | None = Field(None, description="PEM CA bundle to verify TLS with.")
    max_concurrency: int = Field(
        64, ge=1, le=4096, description="Requests in flight at once (and connection pool size).",
    )
    connect_timeout_s: float = Field(
        2.0, gt=0, le=300,
        description="TCP/TLS connect timeout; short, so a dead endpoint fails fast.",
    )
    read_timeout_s: float = Field(
        5.0, gt=0, le=600,
        description="Socket read timeout per request (the start-up probe uses at "
        "most 2 s).",
    )
    retry_mode: Literal["standard", "adaptive", "legacy"] = Field(
        "standard", description="botocore retry mode (5xx, SlowDown, timeouts are retried).",
    )
    max_attempts: int = Field(3, ge=1, le=20, description="Attempts per request, retries incl.")
    request_deadline_s: float = Field(
        10.0, gt=0, le=600,
        description="Deadline of one batch of requests (retries included); past "
        "it the batch fails with a transient error: a load that cannot arrive by then is a "
        "miss, and the failure counts towards the circuit breaker.",
    )
    storage_class: str | None = Field(
        None, description="StorageClass of stored objects: one of S3's (STANDARD, "
        "INTELLIGENT_TIERING...; botocore's list), or with endpoint_url the server's own "
        "class in capitals, digits and '_' (a Ceph RGW placement's, e.g. COLD).",
    )
    sse: Literal["AES256", "aws:kms"] | None = Field(
        None, description="Server-side encryption: AES256 (SSE-S3) or aws:kms (SSE-KMS).",
    )
    sse_kms_key_id: str | None = Field(None, description="KMS key id/ARN for sse='aws:kms'.")
    sse_unverified_ok: bool = Field(
        False, description="Start although the server does not confirm 'sse' (no "
        "x-amz-server-side-encryption header in its answer to the start-up probe's PUT). "
        "Off: such a server fails start-up, since one that ignores the request (Ceph RGW 16 "
        "without a KMS does) stores the blocks unencrypted. Set it only for a server known to "
        "encrypt without saying so.",
    )
    create_bucket: bool = Field(False, description="Create the bucket at startup if missing.")
    negative_cache_s: float = Field(
        2.0, ge=0, le=3600,
        description="Seconds a block an existence check found absent is remembered as absent "
        "(lookups of it send no request meanwhile); 0 disables.",
    )
    lookup_prefetch_bytes: int = Field(
        256 << 20, ge=0, le=1 << 40,
        description="Existence checks GET a block instead of HEADing it and hold its body "
        "for the load that follows, up to this many bytes held at once (each at most "
        "30 s): one request and one round trip per block found, not two. Past it they "
        "HEAD. 0: HEADs only.",
    )
    huge_pages: bool = Field(
        True,
        description="GET bodies land in mappings advised to use transparent huge pages, "
        "where the kernel offers them for advised memory (its transparent_hugepage setting "
        "is always or madvise): a fresh engine's first large load faults once per 2 MiB, "
        "not per 4 KiB. false: the HTTP client's own buffers (for a host whose THP "
        "compaction stalls).",
    )
    namespace_record_refresh_s: float = Field(
        21600.0, gt=0, le=43200,
        description="Seconds between rewrites of the namespace's config.json while the tier "
        "runs, so a lifecycle rule expiring the blocks (one day at the least) never expires "
        "the record of a namespace in use.",
    )
    conditional_put: bool = Field(
        True, description="Use If-None-Match: * so an existing object is never rewritten "
        "(falls back to plain PUT if the server does not implement it).",
    )

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint(cls, url: str | None) -> str | None:
        if url is None:
            return url
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"must be an http:// or https:// URL with a host, not {url!r}")
        url_port(parts)
        return url

    @field_validator("region")
    @classmethod
    def _region(cls, region: str | None) -> str | None:
        problem = None if region is None else _region_problem(region)
        if problem:
            raise ValueError(problem)
        return region

    @field_validator("storage_class")
    @classmethod
    def _storage_class(cls, name: str | None, info: ValidationInfo) -> str | None:
        # S3 answers an unknown class with InvalidStorageClass on every PUT.
        if name is None:
            return name
        known = storage_classes()
        if not known or name in known:
            return name
        if info.data.get("endpoint_url") and _OWN_STORAGE_CLASS.match(name):
            return name  # an S3-compatible server may define its own classes
        raise ValueError(f"not an S3 storage class: {name[:70]!r} (S3's: {', '.join(known)}; "
                         "with endpoint_url, also a server's own class in capitals, digits "
                         "and '_')")

    @field_validator("ca_bundle")
    @classmethod
    def _ca_bundle(cls, path: str | None) -> str | None:
        # A missing bundle would pass start-up here and fail every request.
        if path is not None and not os.path.isfile(os.path.expanduser(path)):
            raise ValueError(f"no such file: {path!r}")
        return path

    @model_validator(mode="after")
    def _check(self) -> S3Config:
        if self.sse_kms_key_id and self.sse != "aws:kms":
            raise ValueError("sse_kms_key_id needs sse='aws:kms'")
        if self.sse_unverified_ok and not self.sse:
            raise ValueError("sse_unverified_ok needs sse")
        if (self.aws_access_key_id is None) != (self.aws_secret_access_key is None):
            raise ValueError("aws_access_key_id and aws_secret_access_key go together")
        if self.aws_session_token is not None and self.aws_access_key_id is None:
            raise ValueError("aws_session_token needs aws_access_key_id/aws_secret_access_key")
        if self.profile and self.aws_access_key_id is not None:
            raise ValueError("give either 'profile' or explicit keys, not both")
        if self.prefix.startswith("/"):
            raise ValueError("prefix must not start with '/'")
        return self

    def secret_remedy(self, key: str) -> str:
        return ("the AWS credential chain: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY "
                "(/ AWS_SESSION_TOKEN) in the environment, a shared-config 'profile', or an "
                "instance, container or web-identity role")

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


