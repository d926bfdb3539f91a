"""The S3 clients of the s3 tier, built from one :class:`S3Config`.

The data path uses aiobotocore on one event-loop thread the backend owns
(:class:`EventLoop`); administration (start-up probe, listing, lifecycle)
uses boto3 (:func:`make_sync_client`). Both are built by
:func:`client_kwargs`/:func:`client_config`, so they reach the same endpoint
with the same credentials and TLS settings. Secrets
(``aws_access_key_id``, ``aws_secret_access_key``, ``aws_session_token``)
are revealed only when handed to a client constructor.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from kvstore_tiers.backends.s3.config import S3Config, scrub
from kvstore_tiers.errors import ConfigError, ObjectMissing, TransientError
from kvstore_tiers.ratelimit import RateLimitedLogger

logger = logging.getLogger(__name__)
T = TypeVar("T")


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
    config: S3Config, *, max_attempts: int | None = None, pool: int | None = None,
    read_timeout: float | None = None,
) -> dict[str, Any]:
    """Keyword arguments of botocore's ``Config``/aiobotocore's ``AioConfig``."""
    return {
        "connect_timeout": config.connect_timeout_s,
        "read_timeout": read_timeout or config.read_timeout_s,
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


def make_sync_client(config: S3Config, *, max_attempts: int | None = None,
                     read_timeout: float | None = None) -> Any:
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
        "s3", config=Config(**client_config(config, max_attempts=max_attempts, pool=4,
                                            read_timeout=read_timeout)),
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


def server_says(exc: BaseException) -> str:
    """'Code: message' of a botocore ClientError as the server wrote them (the
    message left out when it sent none; '' if neither)."""
    resp = getattr(exc, "response", None)
    err = resp.get("Error", {}) if isinstance(resp, dict) else {}
    code, message = str(err.get("Code") or ""), str(err.get("Message") or "")
    return f"{code}: {message}" if code and message else code or message


#: Error codes that mean "no such object".
MISSING_CODES = {"NoSuchKey", "404", "NotFound"}


def backend_error(config: S3Config, exc: BaseException, what: str) -> BaseException:
    """Map a client exception onto ObjectMissing/TransientError (secrets scrubbed)."""
    code, status = error_code(exc)
    if status == 404 or code in MISSING_CODES:
        return ObjectMissing(what)
    if isinstance(exc, asyncio.TimeoutError):
        return TransientError(f"{what}: timed out")
    detail = f"{code} (HTTP {status})" if code or status else f"{type(exc).__name__}: {exc}"
    err = TransientError(scrub(f"{what}: {detail}", config))
    err.__cause__ = exc
    return err




class EventLoop:
    """An asyncio loop on its own daemon thread, fed coroutines from other threads.

    Errors the loop cannot hand to anyone (a task of a dropped connection whose
    exception nobody retrieves, a callback that raised) go to
    :meth:`_on_loop_error`: one WARNING line per kind of message per
    ``LOOP_ERROR_INTERVAL_S``, with the exception's type and text but no
    traceback, rather than asyncio's default ERROR traceback per connection.
    """

    #: Seconds between two log lines of the same kind of loop error.
    LOOP_ERROR_INTERVAL_S = 60.0

    def __init__(self, name: str) -> None:
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._warn = RateLimitedLogger(logger, interval_s=self.LOOP_ERROR_INTERVAL_S)

    @property
    def running(self) -> bool:
        return self._loop is not None and self._loop.is_running()

    def start(self) -> None:
        loop = asyncio.new_event_loop()
        loop.set_exception_handler(self._on_loop_error)
        ready = threading.Event()

        def main() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.run_forever()
            # Stopped by stop(): let cancelled tasks unwind, then close.
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            # aiohttp resolves host names in the loop's default executor: join
            # its threads, or every closed backend leaves one behind.
            with contextlib.suppress(Exception):
                loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()

        self._loop = loop
        self._thread = threading.Thread(target=main, name=self.name, daemon=True)
        self._thread.start()
        ready.wait()

    def _on_loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = str(context.get("message") or "event loop error")
        exc = context.get("exception")
        detail = f"{type(exc).__name__}: {exc}" if exc is not None else ""
        self._warn.warning(message, "s3 tier: %s (%s)", message, detail or "no exception")

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; TransientError if the loop is stopped."""
        loop = self._loop
        if loop is None:
            coro.close()
            raise TransientError("s3 backend is closed")
        return asyncio.run_coroutine_threadsafe(coro, loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on the loop and wait for it at most ``timeout`` seconds."""
        fut = self.submit(coro)
        try:
            return fut.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TransientError(f"s3 requests did not finish within {timeout}s") from None

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop and join its thread. Idempotent."""
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=timeout)
