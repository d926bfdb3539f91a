"""The start-up probe of the s3 tier: endpoint, credentials, bucket, write access."""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass
from typing import Any

from kvstore_tiers.backends.s3.client import error_code, make_sync_client
from kvstore_tiers.backends.s3.config import S3Config, put_extra_args, scrub
from kvstore_tiers.errors import ConfigError

logger = logging.getLogger(__name__)

_CREDENTIAL_CODES = {
    "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken",
    "TokenRefreshRequired", "InvalidClientTokenId", "AuthorizationHeaderMalformed",
}


#: Bytes of the probe object.
PROBE_BYTES = 64
#: Read timeout of the probe's requests (at most; ``read_timeout_s`` if lower) and
#: attempts per request: an endpoint that never answers fails start-up in about
#: 7 s (botocore sends a timed-out request once more).
PROBE_READ_TIMEOUT_S = 2.0
PROBE_ATTEMPTS = 2


def _exists(client: Any, bucket: str, key: str) -> bool:
    from botocore.exceptions import ClientError

    try:
        client.head_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        code, status = error_code(exc)
        if status == 404 or code in ("NoSuchKey", "404", "NotFound"):
            return False
        raise
    return True


@dataclass(frozen=True)
class ProbeResult:
    """What the startup probe learned about the server."""

    conditional_put: bool
    bucket_created: bool


def probe(config: S3Config, namespace_name: str | None = None,
          run_config: dict[str, Any] | None = None) -> ProbeResult:
    """Check endpoint, credentials, bucket and write access; learn If-None-Match support.

    Requests: HeadBucket (+ ListObjectsV2 to name a 403, + CreateBucket if
    allowed); a probe object of random bytes under the prefix is PUT, read
    back byte-exact, PUT again with If-None-Match, DELETEd and HEADed gone --
    so an endpoint that is not S3 (a web server answering 200 to anything)
    fails here rather than "storing" into nothing -- and (with
    ``namespace_name``) one PUT of the namespace's ``config.json`` so an
    administrator can tell what each namespace holds.

    The probe's client makes :data:`PROBE_ATTEMPTS` attempts per request with
    a read timeout of at most :data:`PROBE_READ_TIMEOUT_S`, so an endpoint that accepts
    connections and never answers fails start-up within seconds.

    Raises ConfigError whose message says which of endpoint, credentials,
    bucket or permission is wrong, without any secret in it.
    """
    from botocore.exceptions import (
        BotoCoreError,
        ClientError,
        EndpointConnectionError,
        NoCredentialsError,
        ReadTimeoutError,
        SSLError,
    )

    where = config.where
    read_timeout = min(config.read_timeout_s, PROBE_READ_TIMEOUT_S)
    client = make_sync_client(config, max_attempts=PROBE_ATTEMPTS, read_timeout=read_timeout)
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
        # Random bytes: a server that answers every request with the same
        # canned reply (a plain web server, a captive portal) cannot echo them.
        body = os.urandom(PROBE_BYTES)
        extra = put_extra_args(config)
        conditional = config.conditional_put
        try:
            client.put_object(Bucket=bucket, Key=probe_key, Body=body, **extra)
            if client.get_object(Bucket=bucket, Key=probe_key)["Body"].read() != body:
                raise fail(f"{where} does not behave like S3: an object written under "
                           f"s3://{bucket}/{config.key_prefix} did not read back "
                           "byte-exact (is endpoint_url an S3 API endpoint?)")
            if conditional:
                try:
                    client.put_object(Bucket=bucket, Key=probe_key, Body=body,
                                      IfNoneMatch="*", **extra)
                    # Accepted although the object exists: the header is ignored.
                    conditional = False
                except ClientError as exc:
                    code, status = error_code(exc)
                    if status not in (412, 409):
                        conditional = False
            client.delete_object(Bucket=bucket, Key=probe_key)
            if _exists(client, bucket, probe_key):
                raise fail(f"{where} does not behave like S3: an object deleted under "
                           f"s3://{bucket}/{config.key_prefix} is still there "
                           "(is endpoint_url an S3 API endpoint?)")
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
    except ReadTimeoutError:
        raise fail(f"endpoint {where} accepted the connection but did not answer within "
                   f"{read_timeout:g}s ({PROBE_ATTEMPTS} attempts)") from None
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


