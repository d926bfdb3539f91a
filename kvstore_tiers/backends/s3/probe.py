"""The start-up probe of the s3 tier: endpoint, credentials, bucket, write access."""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass
from typing import Any

from kvstore_tiers.backends.s3.client import error_code, make_sync_client, server_says
from kvstore_tiers.backends.s3.config import S3Config, put_extra_args, scrub
from kvstore_tiers.backends.s3.record import record_put_args
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


def _check_sse(config: S3Config, answer: dict[str, Any]) -> None:
    """Fail naming ``sse`` unless the server confirmed the encryption asked for.

    A server may accept ``x-amz-server-side-encryption`` and store plaintext
    (Ceph RGW 16 without a KMS does, answering without the header); only its
    answer says the object was encrypted. ``sse_unverified_ok`` lets a server
    that encrypts without saying so start, with a warning.
    """
    if not config.sse:
        return
    said = answer.get("ServerSideEncryption")
    if said == config.sse:
        return
    got = f"'{said}'" if said else "no x-amz-server-side-encryption header"
    if config.sse_unverified_ok:
        logger.warning("s3 tier: %s did not confirm sse=%r (%s in its answer); starting "
                       "anyway (sse_unverified_ok)", config.where, config.sse, got)
        return
    raise ConfigError(scrub(
        f"s3 tier: key 'sse': {config.where} did not confirm server-side encryption "
        f"{config.sse!r} of the start-up probe's object ({got} in its answer), so blocks may be "
        "stored unencrypted. Use a server that encrypts (and says so), or set "
        "sse_unverified_ok: true for one known to encrypt without saying so", config))


def _rejected_key(client: Any, config: S3Config, probe_key: str, body: bytes) -> str | None:
    """Which of ``storage_class`` and ``sse`` made the server reject the probe's
    PUT (None: neither is set, or a plain PUT fails too, so something else is
    wrong). The PUT is tried without them, then, with both set, with each alone;
    an accepted object is deleted again."""
    from botocore.exceptions import ClientError

    groups = {"storage_class": {"StorageClass": config.storage_class}} \
        if config.storage_class else {}
    if config.sse:
        groups["sse"] = {k: v for k, v in put_extra_args(config).items() if k != "StorageClass"}
    tries = [({}, None)] + ([(args, key) for key, args in groups.items()]
                            if len(groups) > 1 else [])
    for args, key in tries:
        try:
            client.put_object(Bucket=config.bucket, Key=probe_key, Body=body, **args)
        except ClientError:
            return key
        client.delete_object(Bucket=config.bucket, Key=probe_key)
    return next(iter(groups)) if len(groups) == 1 else None


def _key_rejected(config: S3Config, key: str, exc: BaseException) -> str:
    """The start-up error of a PUT the server rejected for ``key``, with its own words."""
    said = server_says(exc)
    where = f"{config.where} (s3://{config.bucket}/{config.key_prefix})"
    if key == "storage_class":
        return (f"key 'storage_class': {where} rejects storage class {config.storage_class!r} "
                f"({said}); use one the server has (on Ceph RGW: a storage class of the "
                "bucket's placement)")
    msg = f"key 'sse': {where} rejects server-side encryption {config.sse!r} ({said})"
    if (config.endpoint_url or "").startswith("http://"):
        msg += ("; servers such as Ceph RGW take server-side encryption only over TLS: use an "
                "https:// endpoint_url")
    if config.sse == "aws:kms" and not config.sse_kms_key_id:
        msg += "; set sse_kms_key_id to the KMS key to encrypt with"
    return msg


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
    fails here rather than "storing" into nothing. With ``sse`` the server
    must confirm the encryption in its answer to that PUT (or
    ``sse_unverified_ok``); a PUT the server rejects because of
    ``storage_class`` or ``sse`` fails naming that key, in the server's own
    words (the PUT is tried without them, and with each alone, to tell
    which). And (with
    ``namespace_name``) one PUT of the namespace's ``config.json`` so an
    administrator can tell what each namespace holds.

    The probe's client makes :data:`PROBE_ATTEMPTS` attempts per request with
    a read timeout of at most :data:`PROBE_READ_TIMEOUT_S`, so an endpoint that accepts
    connections and never answers fails start-up within seconds.

    Raises ConfigError whose message says which of endpoint, credentials,
    bucket, permission, ``storage_class`` or ``sse`` is wrong, without any
    secret in it.
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
            try:
                answer = client.put_object(Bucket=bucket, Key=probe_key, Body=body, **extra)
            except ClientError as exc:
                code, status = error_code(exc)
                key = None
                if extra and code not in _CREDENTIAL_CODES and status in (400, 403):
                    key = _rejected_key(client, config, probe_key, body)
                if key is None:
                    raise
                raise fail(_key_rejected(config, key, exc)) from None
            try:
                _check_sse(config, answer)
            except ConfigError:
                client.delete_object(Bucket=bucket, Key=probe_key)
                raise
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
                       f"({server_says(exc) or status})") from None
        if conditional != config.conditional_put:
            logger.info("s3 tier: %s ignores or rejects If-None-Match; using plain PUT", where)
        if namespace_name and run_config is not None:
            client.put_object(**record_put_args(config, namespace_name, run_config))
        return ProbeResult(conditional_put=conditional, bucket_created=created)
    except ConfigError:
        raise
    except NoCredentialsError:
        raise fail(f"no AWS credentials found: use {config.secret_remedy('aws_access_key_id')}"
                   ) from None
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


