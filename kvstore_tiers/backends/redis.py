"""The redis backend: one Redis string per block, on a server or a Redis Cluster.

Key layout: ``<key_prefix><object name>``, e.g.
``kvstore:org_model_1a2b3c4d5e6f/0ab/cd_g0/0abcd....kvf``. The value is the
whole frame (:mod:`kvstore_tiers.frame`: header + payload), written with one
``SET key frame NX [EX ttl]`` so a block is visible only once complete and a
block that already exists is never rewritten (content-addressed keys: the same
key always holds the same bytes). Keys carry no hash tag, so in a cluster
they spread over every slot.

Batching: the core hands this backend ``pipeline_batch`` (its ``tuning``)
chunks per I/O task; each batch is one non-transactional pipeline (one round
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
then the environment, then the URL. A password is never logged, never part
of :meth:`RedisBackend.describe`, of an error message or of a repr; URLs are
shown with their credentials removed.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import redis
import redis.exceptions as rexc
from pydantic import Field, SecretStr, model_validator
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from kvstore_tiers.backends.base import (
    Backend,
    Buffer,
    IOTuning,
    LoadItem,
    ObjectInfo,
    StoreItem,
    encode_batch,
)
from kvstore_tiers.config import TierConfig, validate_config
from kvstore_tiers.errors import (
    BackendError,
    ConfigError,
    ObjectCorrupt,
    ObjectMissing,
    TransientError,
)
from kvstore_tiers.frame import HEADER_FIXED, FrameCodec, created_ms
from kvstore_tiers.ratelimit import RateLimitedLogger

logger = logging.getLogger(__name__)

DEFAULT_PASSWORD_ENV = "KVSTORE_REDIS_PASSWORD"
DEFAULT_USERNAME_ENV = "KVSTORE_REDIS_USERNAME"
SUFFIX = ".kvf"


class RedisConfig(TierConfig):
    """Keys of the redis tier (``{"type": "redis", ...}`` in ``secondary_tiers``)."""

    # repr=False: a URL may embed a password (redis://:pw@host); describe() redacts it.
    url: str | None = Field(
        None, repr=False, description="Server URL: redis://host:port/db, rediss:// (TLS) or "
        "unix:///path/redis.sock. Default redis://127.0.0.1:6379/0 unless 'nodes' is set.",
    )
    cluster: bool = Field(False, description="Talk to a Redis Cluster (redis-py RedisCluster).")
    nodes: list[str] | None = Field(
        None, description="Cluster startup nodes as 'host:port' (implies cluster: true).",
    )
    tls: bool = Field(False, description="Use TLS with 'nodes' (with 'url', use rediss://).")
    username: str | None = Field(None, description="ACL user name.")
    password: SecretStr | None = Field(
        None, description="ACL/requirepass password. Prefer password_env in shared configs.",
    )
    username_env: str = Field(
        DEFAULT_USERNAME_ENV, description="Environment variable read when 'username' is unset.",
    )
    password_env: str = Field(
        DEFAULT_PASSWORD_ENV, description="Environment variable read when 'password' is unset.",
    )
    tls_ca_file: str | None = Field(None, description="CA bundle that signed the server cert.")
    tls_cert_file: str | None = Field(None, description="Client certificate (mutual TLS).")
    tls_key_file: str | None = Field(None, description="Client private key (mutual TLS).")
    tls_check_hostname: bool = Field(True, description="Verify the server name in its cert.")
    key_prefix: str = Field("kvstore:", description="Prefix of every key this tier writes.")
    ttl_s: int | None = Field(
        None, ge=1, description="Expire blocks this many seconds after their last hit "
        "(SET EX; a load refreshes it). None: keep until evicted by maxmemory.",
    )
    max_connections: int | None = Field(
        None, ge=1, description="Connection pool size (per node in cluster mode). "
        "Default: n_read_threads + n_write_threads + 4.",
    )
    socket_timeout_s: float = Field(5.0, gt=0, description="Timeout of one socket read/write.")
    connect_timeout_s: float = Field(2.0, gt=0, description="Timeout of one TCP/TLS connect.")
    retries: int = Field(
        2, ge=0, le=10, description="Retries (exponential backoff, 50 ms doubling, capped "
        "at 1 s) of a command after a connection error or timeout.",
    )
    pipeline_batch: int = Field(
        8, ge=1, le=256, description="Blocks per pipeline (per I/O task).",
    )
    fast_io: bool = Field(
        True, description="Zero-copy SET/GET on a single server (see redis_fastio); "
        "false: plain redis-py pipelines.",
    )

    @model_validator(mode="after")
    def _check(self) -> RedisConfig:
        if self.url is not None and self.nodes:
            raise ValueError("set either 'url' or 'nodes', not both")
        if self.url is not None:
            scheme = urlsplit(self.url).scheme
            if scheme not in ("redis", "rediss", "unix"):
                raise ValueError(
                    f"url scheme must be redis://, rediss:// or unix://, not {scheme or '(none)'}"
                )
            tls_files = self.tls_ca_file or self.tls_cert_file or self.tls_key_file
            if tls_files and scheme != "rediss":
                raise ValueError("TLS files are set but the url is not rediss://")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if (self.cluster or self.nodes) and ("{" in self.key_prefix or "}" in self.key_prefix):
            # A hash tag would pin every key to one slot (one node).
            raise ValueError("key_prefix must not contain '{' or '}' in cluster mode")
        return self

    @property
    def is_cluster(self) -> bool:
        return self.cluster or bool(self.nodes)


def redact_url(url: str) -> str:
    """``url`` without its password (the user name is kept)."""
    parts = urlsplit(url)
    if parts.password is None and "@" not in parts.netloc:
        return url
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user = userinfo.split(":", 1)[0]
    netloc = f"{user}:***@{hostport}" if ":" in userinfo else f"{user}@{hostport}"
    return urlunsplit(parts._replace(netloc=netloc))


def _split_credentials(url: str) -> tuple[str, str | None, str | None]:
    """(url without user info, user name, password) -- so ours can take precedence."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url, None, None
    _, _, hostport = parts.netloc.rpartition("@")
    user = unquote(parts.username) if parts.username else None
    pwd = unquote(parts.password) if parts.password is not None else None
    return urlunsplit(parts._replace(netloc=hostport)), user, pwd


def classify_redis(exc: BaseException) -> BackendError:
    """Map a redis-py (or other) exception onto the backend error kinds.

    Everything the server or the network can answer is transient: connection
    refused/reset, timeouts, ``-OOM``, ``-LOADING``, ``-READONLY``,
    ``CLUSTERDOWN``, MOVED storms. The message carries the server's text
    (which never contains credentials).
    """
    if isinstance(exc, BackendError):
        return exc
    if isinstance(exc, rexc.OutOfMemoryError):
        err = TransientError(f"redis is out of memory (maxmemory reached): {exc}")
    elif isinstance(exc, rexc.BusyLoadingError):
        err = TransientError(f"redis is loading its dataset: {exc}")
    elif isinstance(exc, (rexc.ConnectionError, rexc.TimeoutError, OSError)):
        err = TransientError(f"redis connection problem ({type(exc).__name__}): {exc}")
    else:
        err = TransientError(f"redis error ({type(exc).__name__}): {exc}")
    # No __cause__: its traceback would pin the frames of the load path (and
    # with them views of vLLM's primary memory) in a reference cycle, and vLLM
    # could then not unmap the primary at shutdown. The message says it all.
    return err


@dataclass(frozen=True)
class GcReport:
    """Outcome of :meth:`RedisBackend.gc`."""

    scanned: int
    deleted: int
    freed_bytes: int
    remaining_bytes: int


class RedisBackend(Backend):
    """Blocks as Redis strings. Thread-safe: one client, a blocking connection pool."""

    name = "redis"
    config_model = RedisConfig
    remote = True
    supports_touch = True

    def __init__(self, config: RedisConfig, namespace: Any) -> None:
        super().__init__(config, namespace)
        self.config: RedisConfig = config
        self.prefix = config.key_prefix
        self.client: Any = None
        self.use_getex = True
        self.maxmemory: int | None = None
        self.maxmemory_policy: str | None = None
        self._warn = RateLimitedLogger(logger, interval_s=30.0)
        self._username, self._password = self._credentials()
        self._fast: Any = None  # FastIO for a single server; None in cluster mode

    @property
    def tuning(self) -> IOTuning:
        """``pipeline_batch`` chunks per task, loads and stores alike."""
        return IOTuning(load_batch=self.config.pipeline_batch,
                        store_batch=self.config.pipeline_batch)

    # -- configuration -------------------------------------------------------------
    def _credentials(self) -> tuple[str | None, str | None]:
        """(username, password): config key, then environment, then URL."""
        cfg = self.config
        url_user = url_pwd = None
        if cfg.url:
            _, url_user, url_pwd = _split_credentials(cfg.url)
        user = cfg.username or os.environ.get(cfg.username_env) or url_user
        if cfg.password is not None:
            pwd: str | None = cfg.password.get_secret_value()
        else:
            pwd = os.environ.get(cfg.password_env) or url_pwd
        return user, pwd

    @property
    def _url(self) -> str:
        return self.config.url or "redis://127.0.0.1:6379/0"

    def _retry(self) -> Retry:
        # Bounded: at most `retries` extra attempts, 50 ms .. 1 s apart, so a
        # dead server costs an I/O task about a second, never minutes.
        return Retry(ExponentialBackoff(cap=1.0, base=0.05), self.config.retries)

    def _tls_kwargs(self) -> dict[str, Any]:
        cfg = self.config
        kw: dict[str, Any] = {"ssl_cert_reqs": "required",
                              "ssl_check_hostname": cfg.tls_check_hostname}
        if cfg.tls_ca_file:
            kw["ssl_ca_certs"] = cfg.tls_ca_file
        if cfg.tls_cert_file:
            kw["ssl_certfile"] = cfg.tls_cert_file
            kw["ssl_keyfile"] = cfg.tls_key_file
        return kw

    def _common_kwargs(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "username": self._username,
            "password": self._password,
            "socket_timeout": cfg.socket_timeout_s,
            "socket_connect_timeout": cfg.connect_timeout_s,
            "retry": self._retry(),
            "health_check_interval": 0,
        }

    def _pool_size(self) -> int:
        cfg = self.config
        return cfg.max_connections or (cfg.n_read_threads + cfg.n_write_threads + 4)

    def _make_client(self) -> Any:
        cfg = self.config
        kw = self._common_kwargs()
        if cfg.is_cluster:
            from redis.cluster import ClusterNode, RedisCluster

            kw["max_connections"] = self._pool_size()
            # Other slots keep serving while one node is down.
            kw["require_full_coverage"] = False
            if cfg.nodes:
                startup = []
                for node in cfg.nodes:
                    host, _, port = node.rpartition(":")
                    if not host or not port.isdigit():
                        raise ConfigError(f"redis tier: key 'nodes': {node!r} is not host:port")
                    startup.append(ClusterNode(host, int(port)))
                if cfg.tls:
                    kw.update(ssl=True, **self._tls_kwargs())
                return RedisCluster(startup_nodes=startup, **kw)
            url, _, _ = _split_credentials(self._url)
            if urlsplit(url).scheme == "rediss":
                kw.update(self._tls_kwargs())
            return RedisCluster.from_url(url, **kw)
        url, _, _ = _split_credentials(self._url)
        if urlsplit(url).scheme == "rediss":
            kw.update(self._tls_kwargs())
        pool = redis.BlockingConnectionPool.from_url(
            url, max_connections=self._pool_size(), timeout=cfg.socket_timeout_s, **kw
        )
        return redis.Redis(connection_pool=pool)

    # -- lifecycle -------------------------------------------------------------------
    def open(self) -> None:
        """Connect, PING, read the eviction settings; fail clearly on a bad setup."""
        where = self.describe()
        try:
            self.client = self._make_client()
            self.client.ping()
        except ConfigError:
            raise
        except rexc.AuthenticationError as exc:
            self._close_client()
            raise ConfigError(
                f"redis tier: authentication failed at {where}: {exc} (check 'username'/"
                f"'password' or the {self.config.password_env} environment variable)"
            ) from None
        except (rexc.ResponseError, rexc.AuthorizationError) as exc:
            self._close_client()
            msg = str(exc)
            if "NOAUTH" in msg or "AUTH" in msg.upper():
                raise ConfigError(
                    f"redis tier: the server at {where} requires a password: set 'password' "
                    f"or the {self.config.password_env} environment variable"
                ) from None
            raise ConfigError(f"redis tier: {where} refused PING: {msg}") from None
        except Exception as exc:  # connection refused, DNS, TLS handshake, timeout
            self._close_client()
            text = str(exc)
            hint = ""
            if "SSL" in text or "ssl" in text or "certificate" in text:
                hint = " (TLS setup: check the rediss:// URL, tls_ca_file, tls_cert_file, " \
                       "tls_key_file and that the server listens with TLS on that port)"
            raise ConfigError(
                f"redis tier: cannot connect to {where}: {type(exc).__name__}: {text}{hint}"
            ) from None
        self._probe_server()
        if not self.config.is_cluster and self.config.fast_io:
            from kvstore_tiers.backends.redis_fastio import FastIO, fast_io_supported

            if fast_io_supported(self.client):
                backoff = ExponentialBackoff(cap=1.0, base=0.05)
                self._fast = FastIO(self.client.connection_pool, self.config.retries,
                                    backoff.compute)

    def _probe_server(self) -> None:
        """Read version and maxmemory settings; warn on settings that hurt a cache."""
        try:
            info = self.client.info("server")
            if self.config.is_cluster and isinstance(info, dict) and "redis_version" not in info:
                info = next(iter(info.values()), {})
            version = tuple(int(x) for x in str(info.get("redis_version", "7.0")).split(".")[:2])
            self.use_getex = version >= (6, 2)
        except Exception as exc:
            logger.info("redis tier: INFO server unavailable (%s); assuming Redis >= 6.2", exc)
        try:
            if self.config.is_cluster:
                per_node = self.client.config_get("maxmemory*", target_nodes="primaries")
                values: dict[str, Any] = (
                    next(iter(per_node.values())) if per_node and isinstance(
                        next(iter(per_node.values())), dict) else per_node
                )
            else:
                values = self.client.config_get("maxmemory*")
        except Exception as exc:
            # Managed services (ElastiCache, Memorystore, ...) often disable CONFIG.
            logger.info(
                "redis tier: cannot read maxmemory settings (%s: %s); make sure the server "
                "evicts (maxmemory-policy allkeys-lru) so a full cache drops old blocks",
                type(exc).__name__, exc,
            )
            return
        try:
            self.maxmemory = int(values.get("maxmemory", 0))
        except (TypeError, ValueError):
            self.maxmemory = None
        self.maxmemory_policy = values.get("maxmemory-policy")
        if self.maxmemory == 0:
            logger.warning(
                "redis tier: %s has no maxmemory limit: Redis will grow until the host runs "
                "out of memory. Set 'maxmemory <bytes>' and 'maxmemory-policy allkeys-lru'.",
                self.describe(),
            )
        elif self.maxmemory_policy == "noeviction":
            logger.warning(
                "redis tier: %s has maxmemory-policy noeviction: once maxmemory is reached "
                "every store fails (-OOM) and new blocks are not cached. Set "
                "'maxmemory-policy allkeys-lru' (CONFIG SET maxmemory-policy allkeys-lru, or "
                "in redis.conf) so Redis drops the least recently used blocks instead.",
                self.describe(),
            )
        elif self.maxmemory_policy and not self.maxmemory_policy.startswith("allkeys"):
            logger.warning(
                "redis tier: %s has maxmemory-policy %s, which only evicts keys with an "
                "expiry; without ttl_s stores fail once memory is full. Prefer allkeys-lru.",
                self.describe(), self.maxmemory_policy,
            )

    def _close_client(self) -> None:
        self._fast = None
        client, self.client = self.client, None
        if client is None:
            return
        try:
            client.close()
        except Exception:  # closing a broken client must not mask the real error
            logger.debug("redis tier: error closing client", exc_info=True)

    def close(self) -> None:
        self._close_client()

    def describe(self) -> str:
        cfg = self.config
        if cfg.nodes:
            where = f"redis cluster nodes={','.join(cfg.nodes)}" + (" (TLS)" if cfg.tls else "")
        else:
            kind = "redis cluster" if cfg.cluster else "redis"
            where = f"{kind} url={redact_url(self._url)}"
        extras = [f"prefix={self.prefix!r}"]
        if self._username:
            extras.append(f"user={self._username}")
        if self._password:
            extras.append("auth=yes")
        if cfg.ttl_s:
            extras.append(f"ttl={cfg.ttl_s}s")
        if self.maxmemory_policy:
            extras.append(f"policy={self.maxmemory_policy}")
        return f"{where} ({', '.join(extras)})"

    def __repr__(self) -> str:
        return f"RedisBackend({self.describe()})"

    # -- keys ------------------------------------------------------------------------
    def key(self, name: str) -> str:
        return self.prefix + name

    def _pipeline(self) -> Any:
        if self.client is None:
            raise TransientError("redis tier is closed")
        return self.client.pipeline(transaction=False)

    def _run(self, build: Callable[[Any, Sequence[Any]], None], items: Sequence[Any],
             per: int = 1) -> list[Any]:
        """Run ``build(pipe, items)`` (``per`` commands per item) as one pipeline.

        Returns one reply or exception per command. In cluster mode a failure
        of the whole pipeline (a dead node, a topology change) is retried as one
        pipeline per node, so keys on healthy nodes still succeed and only the
        dead node's keys carry the error.
        """
        try:
            pipe = self._pipeline()
            build(pipe, items)
            return list(pipe.execute(raise_on_error=False))
        except Exception:
            if not self.config.is_cluster or len(items) <= 1:
                raise
        by_node: dict[str, list[int]] = {}
        for i, item in enumerate(items):
            try:
                node = self.client.get_node_from_key(self._item_key(item)).name
            except Exception:
                node = "?"
            by_node.setdefault(node, []).append(i)
        out: list[Any] = [None] * (len(items) * per)
        for idxs in by_node.values():
            sub = [items[i] for i in idxs]
            try:
                pipe = self._pipeline()
                build(pipe, sub)
                replies: list[Any] = list(pipe.execute(raise_on_error=False))
            except Exception as exc:
                replies = [exc] * (len(sub) * per)
            for j, i in enumerate(idxs):
                out[i * per : (i + 1) * per] = replies[j * per : (j + 1) * per]
        return out

    @staticmethod
    def _item_key(item: Any) -> str:
        return item if isinstance(item, str) else item[0]

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
        """Every block under ``key_prefix + prefix``: name, frame size, creation time.

        SCAN (every primary in a cluster) + one pipeline of STRLEN and
        GETRANGE 0..63 per 256 keys. Reading the header counts as an access
        for Redis's LRU clock.
        """
        for key, size, header in self._scan_frames(prefix):
            created = _created_s(header)
            yield ObjectInfo(key[len(self.prefix):], size, created if created else 0.0)

    def _scan_frames(self, prefix: str = "") -> Iterator[tuple[str, int, Any]]:
        if self.client is None:
            raise TransientError("redis tier is closed")
        pattern = _glob_escape(self.prefix + prefix) + "*"
        batch: list[str] = []

        def flush() -> Iterator[tuple[str, int, Any]]:
            replies = self._run(
                lambda p, ks: [(p.strlen(k), p.getrange(k, 0, HEADER_FIXED - 1)) for k in ks],
                batch, per=2,
            )
            for i, key in enumerate(batch):
                size, header = replies[2 * i], replies[2 * i + 1]
                if isinstance(size, BaseException) or not size:
                    continue  # vanished (expired/evicted) or unreadable right now
                yield key, int(size), header

        for raw in self.client.scan_iter(match=pattern, count=1000):
            key = raw.decode() if isinstance(raw, bytes) else raw
            if not key.endswith(SUFFIX):
                continue
            batch.append(key)
            if len(batch) >= 256:
                yield from flush()
                batch = []
        if batch:
            yield from flush()

    def gc(self, max_age_s: float | None = None, max_bytes: int | None = None,
           prefix: str = "", dry_run: bool = False) -> GcReport:
        """Delete blocks older than ``max_age_s`` (by the frame's created_ms), then the
        oldest ones until at most ``max_bytes`` remain. Keys under ``key_prefix +
        prefix`` only; a key whose header is not a frame counts as infinitely old.
        UNLINK (freed in the background by Redis). Returns what it did."""
        now = time.time()
        found: list[tuple[float, int, str]] = []
        for key, size, header in self._scan_frames(prefix):
            found.append((_created_s(header) or 0.0, size, key))
        found.sort()
        doomed: list[tuple[int, str]] = []
        keep: list[tuple[float, int, str]] = []
        for created, size, key in found:
            if max_age_s is not None and now - created > max_age_s:
                doomed.append((size, key))
            else:
                keep.append((created, size, key))
        total = sum(size for _, size, _ in keep)
        if max_bytes is not None:
            for _created, size, key in keep:  # oldest first
                if total <= max_bytes:
                    break
                doomed.append((size, key))
                total -= size
        if not dry_run:
            for i in range(0, len(doomed), 256):
                chunk = [k for _, k in doomed[i : i + 256]]
                self._run(lambda p, ks: [p.unlink(k) for k in ks], chunk)
        return GcReport(len(found), len(doomed), sum(s for s, _ in doomed), total)

    # -- frames: pipelined batches (what the core calls) ---------------------------------
    def store_many(
        self, items: Sequence[StoreItem], codec: FrameCodec
    ) -> list[int | BaseException]:
        """One pipeline of ``SET key frame NX [EX ttl]``: bytes written, 0 existed."""
        if self._fast is not None:
            return self._store_many_fast(items, codec)
        out, encoded = encode_batch(items, codec, classify_redis)
        frames = [(self.key(items[i].name), _join((h, p))) for i, h, p in encoded]
        slots = [i for i, _h, _p in encoded]
        if not frames:
            return out
        set_args = self._set_args()
        try:
            replies = self._run(lambda p, fs: [p.set(k, v, **set_args) for k, v in fs], frames)
        except Exception as exc:
            err = classify_redis(exc)
            for i in slots:
                out[i] = err
            return out
        for i, (_k, frame), reply in zip(slots, frames, replies, strict=True):
            out[i] = classify_redis(reply) if isinstance(reply, BaseException) \
                else len(frame) if reply is not None else 0
        return out

    def load_many(
        self, items: Sequence[LoadItem], codec: FrameCodec
    ) -> list[int | BaseException]:
        """One pipeline of GET (GETEX with ttl_s: a hit refreshes the expiry)."""
        ttl = self.config.ttl_s
        if self._fast is not None and (self.use_getex or not ttl):
            return self._load_many_fast(items, codec)
        keys = [self.key(it.name) for it in items]
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
            err = classify_redis(exc)
            return [err] * len(items)
        out: list[int | BaseException] = []
        for i, item in enumerate(items):
            value = replies[i * per]
            if isinstance(value, BaseException):
                out.append(classify_redis(value))
                continue
            if value is None:
                out.append(ObjectMissing(keys[i]))
                continue
            try:
                codec.decode_into(item.key, value, item.dest)
                out.append(len(value))
            except ObjectCorrupt as exc:
                out.append(exc)
            except Exception as exc:
                out.append(classify_redis(exc))
        return out


    def _store_many_fast(
        self, items: Sequence[StoreItem], codec: FrameCodec
    ) -> list[int | BaseException]:
        out, encoded = encode_batch(items, codec, classify_redis)
        frames = [(self.key(items[i].name).encode(), h, p) for i, h, p in encoded]
        slots = [i for i, _h, _p in encoded]
        if not frames:
            return out
        try:
            replies = self._fast.set_many(frames, self.config.ttl_s)
        except Exception as exc:
            err = classify_redis(exc)
            for i in slots:
                out[i] = err
            return out
        for i, (_k, h, p), reply in zip(slots, frames, replies, strict=True):
            out[i] = classify_redis(reply) if isinstance(reply, BaseException) \
                else len(h) + len(p) if reply else 0
        return out

    def _load_many_fast(
        self, items: Sequence[LoadItem], codec: FrameCodec
    ) -> list[int | BaseException]:
        keys = [self.key(it.name).encode() for it in items]
        try:
            return self._fast.get_many(keys, items, codec, self.config.ttl_s)
        except Exception as exc:
            err = classify_redis(exc)
            return [err] * len(items)


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


def _glob_escape(text: str) -> str:
    """Escape glob metacharacters for SCAN MATCH."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _created_s(header: Any) -> float | None:
    """Creation time (s since the epoch) from the first 64 bytes of a frame, or None.

    Only the fixed part is read (GETRANGE 0..63, :func:`frame.created_ms`).
    """
    if not isinstance(header, (bytes, bytearray)):
        return None
    ms = created_ms(header)
    return None if ms is None else ms / 1000.0


def gc(config: Mapping[str, Any], max_age_s: float | None = None,
       max_bytes: int | None = None, prefix: str = "", dry_run: bool = False) -> GcReport:
    """Garbage-collect a redis tier described by its config dict (for the CLI).

    ``config`` is the tier's entry of ``secondary_tiers`` (``type``,
    ``module_path``, ``backpressure`` are ignored). Covers every namespace
    under ``key_prefix`` unless ``prefix`` narrows it (e.g. a namespace name).
    """
    values = {k: v for k, v in config.items() if k not in ("type", "module_path", "backpressure")}
    cfg = validate_config(RedisConfig, "redis", values)
    backend = RedisBackend(cfg, namespace=None)
    backend.open()
    try:
        return backend.gc(max_age_s=max_age_s, max_bytes=max_bytes, prefix=prefix,
                          dry_run=dry_run)
    finally:
        backend.close()
