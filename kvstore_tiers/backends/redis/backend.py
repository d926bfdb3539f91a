"""The redis backend class: one Redis string per block, on a server or a Redis Cluster.

Key layout: ``<key_prefix><object name>``, e.g.
``kvstore:org_model_1a2b3c4d5e6f/0ab/cd_g0/0abcd....kvf``. The value is the
whole frame (:mod:`kvstore_tiers.frame`: header + payload), written with one
``SET key frame NX [EX ttl]`` so a block is visible only once complete and a
block that already exists is never rewritten (content-addressed keys: the same
key always holds the same bytes). Keys carry no hash tag, so in a cluster
they spread over every slot.

Batching: the core hands this backend ``pipeline_batch`` chunks per I/O
task; each batch is one non-transactional pipeline (one round
trip; in cluster mode redis-py's cluster pipeline splits it by slot/node).
Lookups are one pipeline of ``EXISTS`` per key (per-key answers). A load
with ``ttl_s`` set uses ``GETEX key EX ttl`` (Redis >= 6.2; ``GET`` +
``EXPIRE`` in the same pipeline on older servers), so a hit refreshes the
expiry in the same round trip.

Errors (what the core then does, see :mod:`kvstore_tiers.errors`):

* a missing key (never stored, evicted by ``maxmemory``, expired) at load ->
  :class:`ObjectMissing` (a miss, recompute);
* a bad frame -> :class:`ObjectCorrupt` (raised by the frame codec; the core
  deletes the key);
* anything from the server or the network -- connection refused or dropped,
  timeout, ``-OOM``, ``-LOADING``, ``CLUSTERDOWN``, a dead cluster node ->
  :class:`TransientError`, per item. Never an exception into vLLM.

Recovery is redis-py's: a dead pooled connection raises, the bounded
:class:`redis.retry.Retry` (exponential backoff) reconnects, and once the
server is back the next batch succeeds; nothing to restart.

Secrets: ``password`` is a :class:`pydantic.SecretStr`; it may also come from
the environment variable named by ``password_env`` (default
``KVSTORE_REDIS_PASSWORD``) or from the URL. Precedence: ``password`` key,
then the environment, then the URL (:func:`.client.credentials`). A password
is never logged, never part of :meth:`RedisBackend.describe`, of an error
message or of a repr; URLs are shown with their credentials removed.

The connection, probe and cluster fallback are in :mod:`.client`, the
zero-copy single-server path in :mod:`.fastio`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

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
from kvstore_tiers.backends.eviction_log import EvictionLog
from kvstore_tiers.backends.redis.client import (
    Build,
    ServerInfo,
    backoff,
    classify_redis,
    close_client,
    connect,
    credentials,
    probe_server,
    run_pipeline,
    warm_pool,
    warn_eviction,
)
from kvstore_tiers.backends.redis.config import RedisConfig
from kvstore_tiers.backends.redis.evictions import EvictionListener, check_notifications
from kvstore_tiers.backends.redis.fastio import FastIO, fast_io_supported, ping_rtt
from kvstore_tiers.backends.redis.listing import iter_objects
from kvstore_tiers.errors import ObjectMissing, TransientError, detached
from kvstore_tiers.ratelimit import RateLimitedLogger
from kvstore_tiers.redact import redact_nodes, redact_url

logger = logging.getLogger(__name__)

#: Keys per pipeline of ``delete_many``.
DELETE_BATCH = 256


class RedisBackend(Backend):
    """Blocks as Redis strings. Thread-safe: one client, a blocking connection pool."""

    name = "redis"
    config_model = RedisConfig
    remote = True
    supports_touch = True
    supports_delete_many = True
    supports_capacity = True  # with maxmemory

    def __init__(self, config: RedisConfig, namespace: Any) -> None:
        super().__init__(config, namespace)
        self.config: RedisConfig = config
        self.prefix = config.key_prefix
        self.client: Any = None
        self.server = ServerInfo()
        self._warn = RateLimitedLogger(logger, interval_s=30.0)
        self._username, self._password = credentials(config)
        self._fast: FastIO | None = None  # single server with fast_io only
        self._evictions: EvictionListener | None = None
        #: The key of an object this process wrote lately (object_bytes() measures it).
        self._recent_key: str | None = None

    @property
    def tuning(self) -> IOTuning:
        """``pipeline_batch`` chunks per task, loads and stores alike (one pipeline each)."""
        return IOTuning(load_batch=self.config.pipeline_batch,
                        store_batch=self.config.pipeline_batch)

    @property
    def use_getex(self) -> bool:
        return self.server.use_getex

    @property
    def maxmemory_policy(self) -> str | None:
        return self.server.maxmemory_policy

    # -- lifecycle -------------------------------------------------------------------
    def open(self) -> None:
        """Connect, PING, read the eviction settings; fail clearly on a bad setup."""
        cfg = self.config
        self.client = connect(cfg, self._username, self._password, self.describe())
        self.server = probe_server(self.client, cfg)
        warn_eviction(self.server, self.describe())
        try:
            events = check_notifications(self.client, cfg.is_cluster, cfg.eviction_events,
                                         bool(cfg.ttl_s), self.describe())
            if events:
                self._follow_evictions(events)
        except Exception:
            self.close()  # the tier is not built: nobody else would close the client
            raise
        if not cfg.is_cluster:  # the load threads' connections, open before the first load
            warm_pool(self.client.connection_pool, cfg.n_read_threads)
        if not cfg.is_cluster and cfg.fast_io and fast_io_supported(self.client):
            self._fast = FastIO(self.client.connection_pool, cfg.retries, backoff().compute,
                                get_depth=cfg.get_depth, rtt_s=ping_rtt(self.client))

    def _follow_evictions(self, events: list[str]) -> None:
        cfg = self.config
        db = 0 if cfg.is_cluster else self.client.connection_pool.connection_kwargs.get("db", 0)
        self.evictions = EvictionLog()
        self._evictions = EvictionListener(
            self.client, cfg.is_cluster, [f"__keyevent@{db}__:{e}" for e in events],
            self.prefix, self.namespace.name, self._on_removed)
        self._evictions.start()

    def _on_removed(self, event: str, keys: list[bytes]) -> None:
        # A listener thread. Deleted objects (another process's gc) leave the
        # index too, but are not evictions: they do not count in objects_evicted.
        # Expired ones are, but say nothing of the tier being full.
        assert self.evictions is not None  # made before the listener
        self.evictions.note(0 if event == "del" else len(keys), keys,
                            for_capacity=event == "evicted")

    def close(self) -> None:
        evictions, self._evictions = self._evictions, None
        if evictions is not None:
            evictions.stop()
        self._fast = None
        client, self.client = self.client, None
        if client is not None:
            close_client(client)

    def capacity_usage(self) -> tuple[int, int] | None:
        """``used_memory`` and ``maxmemory`` from ``INFO memory`` (summed over a
        cluster's nodes); None without a maxmemory limit."""
        client = self.client
        if client is None:
            return None
        info = client.info("memory")
        nodes = [v for v in info.values() if isinstance(v, dict)] if isinstance(info, dict) else []
        nodes = nodes or [info]
        used = sum(int(n.get("used_memory", 0)) for n in nodes)
        limit = sum(int(n.get("maxmemory", 0)) for n in nodes)
        if limit <= 0:
            return None
        return used, limit

    def object_bytes(self) -> int | None:
        """``MEMORY USAGE`` of a key this process wrote lately: its value, name and
        the server's bookkeeping, which ``used_memory`` counts and a frame's size
        does not (about 1.2x a 16 KiB frame's). None before the first write, or
        once that key is gone."""
        key = self._recent_key
        if key is None or self.client is None:
            return None
        n = self.client.memory_usage(key, samples=0)
        return int(n) if n else None

    def describe(self) -> str:
        cfg = self.config
        if cfg.nodes:
            nodes = ",".join(redact_nodes(cfg.nodes))
            where = f"redis cluster nodes={nodes}" + (" (TLS)" if cfg.tls else "")
        else:
            kind = "redis cluster" if cfg.cluster else "redis"
            where = f"{kind} url={redact_url(cfg.effective_url)}"
        extras = [f"prefix={self.prefix!r}"]
        if self._username:
            extras.append(f"user={self._username}")
        if self._password:
            extras.append("auth=yes")
        if cfg.ttl_s:
            extras.append(f"ttl={cfg.ttl_s}s")
        if self.server.maxmemory_policy:
            extras.append(f"policy={self.server.maxmemory_policy}")
        return f"{where} ({', '.join(extras)})"

    def __repr__(self) -> str:
        return f"RedisBackend({self.describe()})"

    # -- keys ------------------------------------------------------------------------
    def key(self, name: str) -> str:
        return self.prefix + name

    def _run(self, build: Build, items: Sequence[Any], per: int = 1) -> list[Any]:
        """One pipeline of ``per`` commands per item (per node after a cluster failure)."""
        return run_pipeline(self.client, self.config.is_cluster, build, items,
                            _item_key, per)

    # -- bytes -----------------------------------------------------------------------
    def _set_args(self) -> dict[str, Any]:
        return {"nx": True, "ex": self.config.ttl_s} if self.config.ttl_s else {"nx": True}

    def put(self, name: str, parts: Sequence[Buffer]) -> bool:
        frame = _join(parts)
        try:
            return self.client.set(self.key(name), frame, **self._set_args()) is not None
        except Exception as exc:
            raise classify_redis(exc) from exc

    def get(self, name: str) -> bytes:
        try:
            value = self.client.get(self.key(name))
        except Exception as exc:
            raise classify_redis(exc) from exc
        if value is None:
            raise ObjectMissing(self.key(name))
        return value

    def exists_many(self, names: Sequence[str]) -> list[bool]:
        """One pipeline of EXISTS per key. A backend failure answers False (a miss)."""
        if not names:
            return []
        keys = [self.key(n) for n in names]
        try:
            replies = self._run(lambda p, ks: [p.exists(k) for k in ks], keys)
        except Exception as exc:
            self._warn.warning("lookup", "redis tier: existence check failed (%s); "
                               "answering miss", classify_redis(exc))
            return [False] * len(names)
        return [not isinstance(r, BaseException) and bool(r) for r in replies]

    def delete(self, name: str) -> None:
        try:
            self.client.unlink(self.key(name))
        except Exception as exc:
            raise classify_redis(exc) from exc

    def delete_many(self, names: Sequence[str]) -> None:
        """Pipelined ``UNLINK`` (freed in the background by Redis), 256 keys per pipeline.

        Missing keys are not an error; a server or network failure is a
        TransientError after the whole batch was tried (per node in a cluster).
        """
        keys = [self.key(n) for n in names]
        failed: BaseException | None = None
        for start in range(0, len(keys), DELETE_BATCH):
            chunk = keys[start : start + DELETE_BATCH]
            try:
                replies = self._run(lambda p, ks: [p.unlink(k) for k in ks], chunk)
            except Exception as exc:
                replies = [exc]
            failed = failed or next((r for r in replies if isinstance(r, BaseException)), None)
        if failed is not None:
            raise detached(classify_redis(failed))

    def touch_many(self, names: Sequence[str]) -> None:
        """Refresh the expiry of ``names`` (ttl_s) or their LRU clock. Best effort."""
        if not names:
            return
        keys = [self.key(n) for n in names]
        ttl = self.config.ttl_s
        try:
            if ttl:
                self._run(lambda p, ks: [p.expire(k, ttl) for k in ks], keys)
            else:
                self._run(lambda p, ks: [p.touch(k) for k in ks], keys)
        except Exception as exc:
            self._warn.warning("touch", "redis tier: touch failed: %s", classify_redis(exc))

    def iter_objects(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every block under ``key_prefix + prefix`` (:func:`.listing.iter_objects`)."""
        if self.client is None:
            raise TransientError("redis tier is closed")
        return iter_objects(self.client, self._run, self.prefix, prefix)

    # -- batches: pipelined (what the core calls) ---------------------------------------
    def write_many(self, writes: Sequence[Write]) -> list[Written]:
        """One pipeline of ``SET key value NX [EX ttl]``: bytes written, 0 existed."""
        if not writes:
            return []
        try:
            if self._fast is not None:
                replies: list[Any] = self._fast.set_many(
                    [(self.key(w.name).encode(), w.parts) for w in writes], self.config.ttl_s)
            else:
                set_args = self._set_args()
                values = [(self.key(w.name), _join(w.parts)) for w in writes]
                replies = self._run(lambda pl, vs: [pl.set(k, v, **set_args) for k, v in vs],
                                    values)
        except Exception as exc:
            replies = [exc] * len(writes)
        out: list[Written] = []
        for w, reply in zip(writes, replies, strict=True):
            # SET NX answers OK (written) or nil (existed): True or None/False here.
            out.append(detached(classify_redis(reply)) if isinstance(reply, BaseException)
                       else sum(len(p) for p in w.parts) if reply else 0)
        written = out[-1]
        if isinstance(written, int) and written > 0:  # a key for object_bytes() to measure
            self._recent_key = self.key(writes[-1].name)
        return out

    def read_many(self, reads: Sequence[Read]) -> list[ReadDone]:
        """One pipeline of GET (GETEX with ttl_s: a hit refreshes the expiry): each
        value read off the socket into its read's buffers where the fast path
        runs, else given whole as redis-py's pipeline returns it."""
        if not reads:
            return []
        ttl = self.config.ttl_s
        keys = [self.key(r.name) for r in reads]
        if self._fast is not None and (self.use_getex or not ttl):
            try:
                placed: list[Any] = self._fast.get_many([k.encode() for k in keys],
                                                        [r.parts for r in reads], ttl)
            except Exception as exc:
                err = detached(classify_redis(exc))
                return [(i, err) for i in range(len(reads))]
            return list(enumerate(placed))
        if ttl and self.use_getex:
            def build(p: Any, ks: Sequence[str]) -> None:
                for k in ks:
                    p.getex(k, ex=ttl)
            per = 1
        elif ttl:
            def build(p: Any, ks: Sequence[str]) -> None:
                for k in ks:
                    p.get(k)
                    p.expire(k, ttl)  # refreshing a block that turns out corrupt is harmless
            per = 2
        else:
            def build(p: Any, ks: Sequence[str]) -> None:
                for k in ks:
                    p.get(k)
            per = 1
        try:
            replies = self._run(build, keys, per)
        except Exception as exc:
            err = detached(classify_redis(exc))
            return [(i, err) for i in range(len(reads))]
        # Every error kept below is detached: its traceback would hold this
        # frame and with it ``reads`` (views of vLLM's primary rows).
        out: list[ReadDone] = []
        for i in range(len(reads)):
            value = replies[i * per]
            if isinstance(value, BaseException):
                out.append((i, detached(classify_redis(value))))
            elif value is None:
                out.append((i, ObjectMissing(keys[i])))
            else:
                out.append((i, value))  # whole, as redis-py handed it: decoded from there
        return out


def _item_key(item: Any) -> str:
    """The Redis key of a pipeline item: a key, or a (key, value) pair."""
    return item if isinstance(item, str) else item[0]


def _join(parts: Sequence[Buffer]) -> memoryview:
    """One buffer holding ``parts`` back to back (a Redis value is one argument)."""
    total = sum(len(p) for p in parts)
    buf = bytearray(total)
    off = 0
    for p in parts:
        n = len(p)
        buf[off : off + n] = p
        off += n
    return memoryview(buf)
