"""The s3 backend class: one S3 object per block, on AWS S3 or any S3-compatible server.

Layout: ``s3://<bucket>/<prefix><namespace>/<hash[:3]>/<hash>_g<g>.kvf``
(:mod:`kvstore_tiers.naming`), plus ``<prefix><namespace>/config.json``
describing the namespace (rewritten while open: :mod:`.record`). The two
hash-derived levels spread keys across S3's per-prefix request-rate
partitions.

Data path (put/get/exists/delete): aiobotocore on ONE event-loop thread
owned by the backend (:class:`.client.EventLoop`). The core's I/O threads
call the synchronous methods below, which submit a coroutine to that loop and wait for it with a
deadline (``request_deadline_s``). An ``asyncio.Semaphore`` of
``max_concurrency`` bounds the requests in flight, so hundreds of requests
overlap without a thread each. The chunks of one pool task (``tuning``) go
out concurrently (``write_many``/``read_many``/``exists_many`` gather).
The core encodes and decodes frames on the pool threads (zstd and CRC-32C
release the GIL); the loop thread only does HTTP (docs/s3.md: why
aiobotocore), and a pool thread hands each GET's body to the core as it lands.

Admin paths use boto3: the start-up probe and bucket creation in
:mod:`.probe`, listing and lifecycle expiry in :mod:`.lifecycle`.

* Atomic publish: one PutObject per block; S3 makes an object visible only
  once whole. With ``If-None-Match: *`` (probed at startup) an existing
  object is never rewritten: 412 means "already there" and put returns
  False. A server that answers 501/NotImplemented to the header is
  remembered and plain PUTs are used from then on (blocks are
  content-addressed, so a rewrite is harmless, only wasted bandwidth).
  Frames are megabytes, far below the 5 GiB single-PUT limit, so there is
  no multipart path.
* Errors: 404 on GET -> ObjectMissing; a frame that does not check out is
  ObjectCorrupt (raised by the core's frame checks; the core deletes the object).
  5xx, SlowDown/throttling, resets and timeouts are retried by botocore's
  retry config (``retry_mode``, ``max_attempts``), then -> TransientError,
  as is a batch that passes ``request_deadline_s``. A short
  ``connect_timeout_s`` makes a dead endpoint fail fast; aiohttp opens new
  connections on the next request, so the client recovers by itself.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import queue
import time
from collections import Counter
from collections.abc import Coroutine, Iterator, Sequence
from typing import Any, TypeVar

from kvstore_tiers.backends.base import (
    Backend,
    Buffer,
    IOTuning,
    ObjectInfo,
    Read,
    ReadDone,
    Write,
    Written,
)
from kvstore_tiers.backends.s3.arena import BodyArena, huge_pages_available
from kvstore_tiers.backends.s3.client import (
    MISSING_CODES,
    EventLoop,
    backend_error,
    client_config,
    client_kwargs,
    error_code,
)
from kvstore_tiers.backends.s3.config import MAX_SINGLE_PUT, S3Config, put_extra_args
from kvstore_tiers.backends.s3.held import HeldBodies
from kvstore_tiers.backends.s3.lifecycle import iter_objects as _iter_objects
from kvstore_tiers.backends.s3.negative_cache import NegativeCache
from kvstore_tiers.backends.s3.probe import probe as _probe
from kvstore_tiers.backends.s3.record import keep_fresh, record_put_args
from kvstore_tiers.errors import ObjectMissing, TransientError, classify
from kvstore_tiers.ratelimit import RateLimitedLogger

logger = logging.getLogger(__name__)
T = TypeVar("T")
#: A GET body: a slice of the arena, or the HTTP client's bytes.
Body = bytes | memoryview

#: Keys per DeleteObjects request (the S3 limit).
DELETE_BATCH = 1000


#: Seconds a body an existence check fetched waits for its load before it is dropped.
HOLD_S = 30.0

#: The absent key start-up HEADs to build the client's request path before a lookup needs it.
WARM_KEY = ".kvstore-warm"


def _cancel(task: asyncio.Task[Body]) -> None:
    """Cancel ``task`` on its loop, from any thread (a held body nobody loaded)."""
    with contextlib.suppress(RuntimeError):  # the loop is closed: nothing left to cancel
        task.get_loop().call_soon_threadsafe(task.cancel)


def _retrieve(task: asyncio.Task[Body]) -> None:
    """Mark a held read's failure retrieved: its load GETs again, nothing to log."""
    if not task.cancelled():
        task.exception()


class S3Backend(Backend):
    """Blocks as S3 objects. Thread-safe: every data method may be called concurrently."""

    name = "s3"
    config_model = S3Config
    remote = True
    supports_delete_many = True

    @property
    def tuning(self) -> IOTuning:
        """16 chunks per pool task, loads and stores: sent as one concurrent batch on the loop."""
        return IOTuning(load_batch=16, store_batch=16)

    def __init__(self, config: S3Config, namespace: Any) -> None:
        super().__init__(config, namespace)
        self.config: S3Config = config
        self.bucket = config.bucket
        self.prefix = config.key_prefix
        self.conditional_put = config.conditional_put
        self._put_extra = put_extra_args(config)
        self._loop = EventLoop("kvstore_s3_loop")
        self._client: Any = None
        self._client_ctx: Any = None
        self._refresh: concurrent.futures.Future[None] | None = None
        self._sem: asyncio.Semaphore | None = None
        #: HTTP requests sent by the data path (retries included), by operation.
        self.requests: Counter[str] = Counter()
        self._absent = NegativeCache(config.negative_cache_s)
        #: Existence checks' GETs still reading, or read, held for their loads.
        self._held: HeldBodies[asyncio.Task[Body]] = HeldBodies(
            config.lookup_prefetch_bytes, HOLD_S, _cancel)
        self._warn = RateLimitedLogger(logger, interval_s=30.0)
        #: Where GET bodies land: huge-page mappings where the kernel gives them
        #: (:mod:`.arena`), else the HTTP client's own buffers.
        self._arena = BodyArena() if config.huge_pages and huge_pages_available() else None

    # -- lifecycle ---------------------------------------------------------------
    def open(self) -> None:
        """Probe endpoint/credentials/bucket (boto3), then start the loop and client."""
        ns = self.namespace
        if not self.config.verify_tls and not self.config.ca_bundle:
            logger.warning("s3 tier: verify_tls is false: the TLS certificate of %s is not "
                           "verified (set ca_bundle instead outside tests)", self.config.where)
        result = _probe(self.config, getattr(ns, "name", None), getattr(ns, "run_config", None))
        self.conditional_put = result.conditional_put
        self._loop.start()
        try:
            self._run(self._open_client(), timeout=30.0)
        except BaseException:
            self.close()
            raise
        self._keep_record_fresh(getattr(ns, "name", None), getattr(ns, "run_config", None))

    def _keep_record_fresh(self, name: str | None, run_config: Any) -> None:
        """Rewrite the namespace record on the loop while open (:mod:`.record`)."""
        if not name or run_config is None:
            return
        args = record_put_args(self.config, name, run_config)
        self._refresh = self._loop.submit(keep_fresh(
            lambda: self._client, args, self.config.namespace_record_refresh_s,
            lambda msg: self._warn.warning("record", "%s", msg)))

    async def _open_client(self) -> None:
        from aiobotocore.config import AioConfig
        from aiobotocore.session import AioSession

        session = AioSession(profile=self.config.profile)
        self._client_ctx = session.create_client(
            "s3", config=AioConfig(**client_config(self.config)), **client_kwargs(self.config)
        )
        self._client = await self._client_ctx.__aenter__()
        self._sem = asyncio.Semaphore(self.config.max_concurrency)
        # A client's first request of an operation builds its request path (operation
        # model, endpoint rules, signer): 0.1-1 s of CPU here, which would land on a fresh
        # engine's first lookup. One request of an absent key, of the operation existence
        # checks send first (GET while they prefetch, else HEAD), pays it at start-up; then
        # max_concurrency more at once open the whole pool, so a fresh engine's first wave
        # of existence checks finds its connections open on a server that keeps them (a
        # new one costs a round trip more at distance). None is counted in `requests`; an
        # error only leaves its cost to the first lookup.
        request = functools.partial(
            self._client.get_object if self._held.enabled else self._client.head_object,
            Bucket=self.bucket, Key=self.prefix + WARM_KEY)

        async def warm() -> None:
            resp = await request()
            if "Body" in resp:  # the key exists after all: free its connection
                resp["Body"].close()

        with contextlib.suppress(Exception):
            await warm()
        await asyncio.gather(*(warm() for _ in range(self.config.max_concurrency)),
                             return_exceptions=True)
        # Count every HTTP attempt (retries included) for the lookup-cost metric.
        self._client.meta.events.register("before-send.s3", self._count_request)

    def _count_request(self, event_name: str = "", **_: Any) -> None:
        # Runs on the loop thread only: no lock needed.
        self.requests[event_name.rsplit(".", 1)[-1]] += 1

    async def _close_client(self) -> None:
        if self._client_ctx is not None:
            ctx, self._client_ctx, self._client = self._client_ctx, None, None
            await ctx.__aexit__(None, None, None)

    def close(self) -> None:
        """Close the client and stop the loop thread. Idempotent."""
        if self._refresh is not None:
            self._refresh.cancel()
            self._refresh = None
        if self._client_ctx is not None and self._loop.running:
            with contextlib.suppress(Exception):
                self._run(self._close_client(), timeout=10.0)
        self._loop.stop()

    def describe(self) -> str:
        c = self.config
        cond = "conditional PUT" if self.conditional_put else "plain PUT"
        enc = f", sse={c.sse}" if c.sse else ""
        return (f"s3 s3://{c.bucket}/{self.prefix} at {c.where} "
                f"(max_concurrency={c.max_concurrency}, {cond}{enc})")

    # -- loop plumbing -----------------------------------------------------------
    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop from a calling thread, within the deadline."""
        return self._loop.run(coro, timeout or self.config.request_deadline_s)

    # -- coroutines (loop thread) ------------------------------------------------
    async def _put(self, key: str, body: bytes) -> bool:
        assert self._sem is not None
        self._absent.forget(key)  # stored (or about to be): no longer "absent"
        async with self._sem:
            if self.conditional_put:
                try:
                    await self._client.put_object(
                        Bucket=self.bucket, Key=key, Body=body, IfNoneMatch="*",
                        **self._put_extra,
                    )
                    return True
                except Exception as exc:
                    code, status = error_code(exc)
                    # 412: it exists. 409: a concurrent conditional write of the
                    # same content-addressed block is in progress -- also "exists".
                    if status in (412, 409):
                        return False
                    if status == 501 or code == "NotImplemented":
                        self.conditional_put = False
                        logger.info("s3 tier: server rejects If-None-Match; using plain PUT")
                    else:
                        raise
            await self._client.put_object(
                Bucket=self.bucket, Key=key, Body=body, **self._put_extra
            )
            return True

    async def _get(self, key: str, arena: bool = True) -> Body:
        reading = self._held.take(key)  # this block's existence check's GET
        if reading is not None:
            await asyncio.wait([reading])  # raises only if this coroutine is cancelled
            if not reading.cancelled() and reading.exception() is None:
                return reading.result()
            # Its read failed (or expired): GET it again.
        assert self._sem is not None
        async with self._sem:
            resp = await self._client.get_object(Bucket=self.bucket, Key=key)
            expected = resp.get("ContentLength")
            async with resp["Body"] as stream:
                data = await self._read_body(stream, expected if arena else None)
            if expected is not None and len(data) != expected:
                # A short body is a transfer problem, not a bad object.
                raise TransientError(f"short read: {len(data)} of {expected} bytes")
            return data

    async def _read_body(self, stream: Any, size: int | None) -> Body:
        """All of ``stream``: into the arena when there is one and ``size`` is known,
        else as the HTTP client joins it. A body that ends short of ``size`` comes
        back short (the caller's short-read check); one that goes on past it raises
        TransientError."""
        if self._arena is None or size is None:
            data: bytes = await stream.read()
            return data
        buf = self._arena.take(size)
        got = 0
        while got < size:
            n = await stream.readinto(buf[got:])
            if not n:
                return buf[:got]
            got += n
        # Read to the end: the client checks the length it was told on the read
        # that finds it, and a body longer than announced is not this object.
        if await stream.readinto(bytearray(1)):
            raise TransientError(f"body longer than its Content-Length of {size} bytes")
        return buf

    async def _head(self, key: str) -> bool:
        assert self._sem is not None
        async with self._sem:
            try:
                await self._client.head_object(Bucket=self.bucket, Key=key)
                return True
            except Exception as exc:
                code, status = error_code(exc)
                if status == 404 or code in MISSING_CODES:
                    return False
                raise

    async def _probe_get(self, key: str) -> bool:
        """An existence check by GET: True once the server answers 200, the body
        read on in a task held for the load (:mod:`.held`) if it fits, else left
        unread (the connection is closed; the load GETs it)."""
        assert self._sem is not None
        await self._sem.acquire()
        try:
            resp = await self._client.get_object(Bucket=self.bucket, Key=key)
        except BaseException as exc:
            self._sem.release()
            code, status = error_code(exc)
            if status == 404 or code in MISSING_CODES:
                return False
            raise
        size = resp.get("ContentLength")
        if size is None or not self._held.reserve(size):
            resp["Body"].close()
            self._sem.release()
            return True
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._read_held(resp, size))
        task.add_done_callback(_retrieve)
        self._held.hold(key, task, size)
        # Its time up, it goes, though no later lookup or load comes to expire it.
        loop.call_later(self._held.hold_s, self._held.sweep)
        return True

    async def _read_held(self, resp: Any, size: int) -> Body:
        """The body of an existence check's GET (its semaphore slot released after)."""
        assert self._sem is not None
        try:
            async with resp["Body"] as stream:
                data = await self._read_body(stream, size)
            if len(data) != size:
                raise TransientError(f"short read: {len(data)} of {size} bytes")
            return data
        finally:
            self._sem.release()

    async def _delete(self, key: str) -> None:
        if (reading := self._held.take(key)) is not None:
            _cancel(reading)  # after the read's first step, so its finally gives its slot back
        assert self._sem is not None
        async with self._sem:
            await self._client.delete_object(Bucket=self.bucket, Key=key)

    async def _delete_batch(self, keys: Sequence[str]) -> list[str]:
        """One DeleteObjects request; returns the S3 error codes of keys it could not delete."""
        assert self._sem is not None
        async with self._sem:
            resp = await self._client.delete_objects(
                Bucket=self.bucket,
                Delete={"Objects": [{"Key": k} for k in keys], "Quiet": True})
        return [str(e.get("Code", "?")) for e in resp.get("Errors", ())]

    async def _gather(self, coros: Sequence[Coroutine[Any, Any, Any]]) -> list[Any]:
        return await asyncio.gather(*coros, return_exceptions=True)

    # -- bytes -------------------------------------------------------------------
    @staticmethod
    def _body(parts: Sequence[Buffer]) -> bytes:
        # One copy: the HTTP client needs a single contiguous body.
        body = b"".join(parts)
        if len(body) > MAX_SINGLE_PUT:
            raise TransientError(f"object of {len(body)} bytes exceeds the 5 GiB PUT limit")
        return body

    def put(self, name: str, parts: Sequence[Buffer]) -> bool:
        body = self._body(parts)
        try:
            return self._run(self._put(self.prefix + name, body))
        except TransientError:
            raise
        except Exception as exc:
            raise backend_error(self.config, exc, f"PUT {name}") from exc

    def get(self, name: str) -> bytes:
        try:
            # A body fetched whole for a caller that keeps it: the client's bytes,
            # not an arena mapping (a held one, read already, is copied out).
            body = self._run(self._get(self.prefix + name, arena=False))
            return body if isinstance(body, bytes) else bytes(body)
        except TransientError:
            raise
        except Exception as exc:
            raise backend_error(self.config, exc, f"GET {name}") from exc

    def exists_many(self, names: Sequence[str]) -> list[bool]:
        """One request per name, all in flight at once (bounded). An error answers False.

        The request is a GET whose body is held for the load that follows while
        ``lookup_prefetch_bytes`` has room for one (:mod:`.held`), else a HEAD.

        Names an existence check found absent less than ``negative_cache_s`` ago answer
        False without a request: requests that share a prefix (or re-ask a
        step later) do not re-probe blocks nobody has stored.
        """
        if not names:
            return []
        keys = [self.prefix + n for n in names]
        known_absent = self._absent.check(keys)
        probe = [k for k, absent in zip(keys, known_absent, strict=True) if not absent]
        found: dict[str, bool] = {}
        if probe:
            n_get = self._held.room_for(len(probe))
            results = self._run(self._gather([self._probe_get(k) for k in probe[:n_get]]
                                             + [self._head(k) for k in probe[n_get:]]))
            for k, r in zip(probe, results, strict=True):
                if isinstance(r, BaseException):
                    err = backend_error(self.config, r, f"lookup of {k}")
                    self._warn.warning("head", "s3 tier: existence check failed (%s); "
                                       "answering miss", err)
                    found[k] = False  # an error is not evidence of absence: not cached
                else:
                    found[k] = bool(r)
                    if not r:
                        self._absent.remember(k)
        return [found.get(k, False) for k in keys]

    def delete(self, name: str) -> None:
        try:
            self._run(self._delete(self.prefix + name))
        except TransientError:
            raise
        except Exception as exc:
            err = backend_error(self.config, exc, f"DELETE {name}")
            if not isinstance(err, ObjectMissing):
                raise err from exc

    def delete_many(self, names: Sequence[str]) -> None:
        """``DeleteObjects`` with up to 1,000 keys per request, the requests concurrent.

        Missing objects are not an error (S3 reports them deleted); any key
        the server could not delete makes this a TransientError naming how
        many, after every request was tried.
        """
        keys = [self.prefix + n for n in names]
        batches = [keys[i : i + DELETE_BATCH] for i in range(0, len(keys), DELETE_BATCH)]
        if not batches:
            return
        what = f"DeleteObjects of {len(keys)} keys"
        try:
            results = self._run(self._gather([self._delete_batch(b) for b in batches]))
        except TransientError:
            raise
        except Exception as exc:
            raise backend_error(self.config, exc, what) from None
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise backend_error(self.config, failed[0], what) from None
        codes = [c for r in results for c in r]
        if codes:
            raise TransientError(f"DeleteObjects: {len(codes)} of {len(keys)} keys not "
                                 f"deleted ({', '.join(sorted(set(codes)))})")

    def iter_objects(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Objects under ``<config prefix><prefix>`` (boto3 listing; admin use)."""
        return _iter_objects(self.config, prefix)

    # -- batches (what the core calls) -------------------------------------------
    def write_many(self, writes: Sequence[Write]) -> list[Written]:
        """PUT the whole batch concurrently: per write the bytes written, 0 existed."""
        if not writes:
            return []
        out: list[Written] = []
        coros: list[Coroutine[Any, Any, bool]] = []
        sent: list[int] = []
        for i, w in enumerate(writes):
            try:
                body = self._body(w.parts)
            except Exception as exc:
                out.append(classify(exc))
                continue
            out.append(0)
            coros.append(self._put(self.prefix + w.name, body))
            sent.append(i)
        if coros:
            try:
                results = self._run(self._gather(coros))
            except Exception as exc:
                err = classify(exc)
                results = [err] * len(coros)
            for i, res in zip(sent, results, strict=True):
                out[i] = (classify(backend_error(self.config, res, f"PUT {writes[i].name}"))
                          if isinstance(res, BaseException)
                          else sum(len(p) for p in writes[i].parts) if res else 0)
        return out

    def read_many(self, reads: Sequence[Read]) -> Iterator[ReadDone]:
        """GET the whole batch concurrently; yield each body whole as it lands, so
        the core checks and decodes a frame on this (pool) thread while the
        batch's other GETs are still on the wire (a task's decode tail is one
        frame, not a batch). Each body is one buffer (an arena slice, or the
        HTTP client's bytes): decoding from it costs no copy into the planned
        buffers."""
        if not reads:
            return
        # queue.Queue, not SimpleQueue: CPython 3.11's SimpleQueue.get(timeout=)
        # can wait past its deadline (see kvstore_tiers.pool), and this
        # timeout is the batch's request_deadline_s.
        landed: queue.Queue[tuple[int, Body | BaseException]] = queue.Queue()

        async def one(i: int, key: str) -> None:
            try:
                landed.put((i, await self._get(key)))
            except Exception as exc:
                landed.put((i, exc))

        async def batch() -> None:
            await asyncio.gather(*(one(i, self.prefix + r.name) for i, r in enumerate(reads)))

        deadline_s = self.config.request_deadline_s
        try:
            fut = self._loop.submit(batch())
        except Exception as exc:  # the loop is gone (closed): every read fails alike
            err = classify(exc)
            for i in range(len(reads)):
                yield i, err
            return
        deadline = time.monotonic() + deadline_s
        pending = set(range(len(reads)))
        try:
            while pending:
                try:
                    i, body = landed.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    late = classify(
                        TransientError(f"s3 requests did not finish within {deadline_s}s"))
                    for j in sorted(pending):
                        yield j, late
                    return
                pending.discard(i)
                if isinstance(body, BaseException):
                    err = body if isinstance(body, TransientError) else \
                        backend_error(self.config, body, f"GET {reads[i].name}")
                    yield i, classify(err)
                    continue
                yield i, body  # whole: the core decodes from it, no copy into the parts first
        finally:
            if pending:  # late, or the caller stopped reading: the rest is not wanted
                fut.cancel()
