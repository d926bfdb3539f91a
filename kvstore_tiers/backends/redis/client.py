"""The redis-py client of the redis tier: credentials, connection, start-up probe,
error mapping and pipelines that survive a dead cluster node.

Everything here is plain redis-py; the zero-copy single-server path that
reaches into redis-py's connections lives in :mod:`.fastio`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit, urlunsplit

import redis
import redis.exceptions as rexc
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from kvstore_tiers.backends.redis.config import RedisConfig
from kvstore_tiers.errors import BackendError, ConfigError, TransientError, detached
from kvstore_tiers.redact import redact_text

logger = logging.getLogger(__name__)
A = TypeVar("A")
R = TypeVar("R")

#: Backoff between retries of a command: 50 ms doubling, capped at 1 s.
BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 1.0


def backoff() -> ExponentialBackoff:
    return ExponentialBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S)


def classify_redis(exc: BaseException) -> BackendError:
    """Map a redis-py (or other) exception onto the backend error kinds.

    Everything the server or the network can answer is transient: connection
    refused/reset, timeouts, ``-OOM``, ``-LOADING``, ``-READONLY``,
    ``CLUSTERDOWN``, MOVED storms. The message carries the server's text
    (which never contains credentials).
    """
    # The original is dropped or kept only as a cause: cut its traceback first. It
    # would hold the frames of the load path (and with them views of vLLM's
    # primary memory), often in a cycle with redis-py's own frames that only
    # the cyclic GC frees, and vLLM could then not unmap the primary at shutdown.
    detached(exc)
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
    return err  # no __cause__: the message says it all


# -- credentials -------------------------------------------------------------------
def split_credentials(url: str) -> tuple[str, str | None, str | None]:
    """(url without user info, user name, password) -- so ours can take precedence."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url, None, None
    _, _, hostport = parts.netloc.rpartition("@")
    user = unquote(parts.username) if parts.username else None
    pwd = unquote(parts.password) if parts.password is not None else None
    bare = urlunsplit(parts._replace(netloc=hostport))
    if not hostport and bare.startswith(f"{parts.scheme}:") and not bare.startswith(
            f"{parts.scheme}://"):
        # unix://:pw@/path.sock: an empty netloc would print as unix:/path.sock,
        # which redis-py refuses; keep the authority marker.
        bare = f"{parts.scheme}://{bare[len(parts.scheme) + 1:]}"
    return bare, user, pwd


def credentials(cfg: RedisConfig) -> tuple[str | None, str | None]:
    """(username, password): config key, then environment, then URL.

    A ``password_env`` the config names explicitly must hold the password when
    nothing else gives one: ConfigError naming the key and the variable, rather
    than a server refusing an empty password later with no word of why.
    """
    url_user = url_pwd = None
    if cfg.url:
        _, url_user, url_pwd = split_credentials(cfg.url)
    user = cfg.username or os.environ.get(cfg.username_env) or url_user
    if cfg.password is not None:
        pwd: str | None = cfg.password.get_secret_value()
    else:
        pwd = os.environ.get(cfg.password_env) or url_pwd
        if pwd is None and "password_env" in cfg.model_fields_set:
            state = "empty" if cfg.password_env in os.environ else "not set"
            raise ConfigError(f"redis tier: key 'password_env': {cfg.password_env} is {state} "
                              "in the environment")
    return user, pwd


# -- client construction -----------------------------------------------------------
def _tls_kwargs(cfg: RedisConfig) -> dict[str, Any]:
    kw: dict[str, Any] = {"ssl_cert_reqs": "required",
                          "ssl_check_hostname": cfg.tls_check_hostname}
    if cfg.tls_ca_file:
        kw["ssl_ca_certs"] = cfg.tls_ca_file
    if cfg.tls_cert_file:
        kw["ssl_certfile"] = cfg.tls_cert_file
        kw["ssl_keyfile"] = cfg.tls_key_file
    return kw


def pool_size(cfg: RedisConfig) -> int:
    return cfg.max_connections or (cfg.n_read_threads + cfg.n_write_threads + 4)


def make_client(cfg: RedisConfig, username: str | None, password: str | None) -> Any:
    """A redis-py client (``Redis`` on a blocking pool, or ``RedisCluster``) for ``cfg``."""
    kw: dict[str, Any] = {
        "username": username,
        "password": password,
        "socket_timeout": cfg.socket_timeout_s,
        "socket_connect_timeout": cfg.connect_timeout_s,
        # Bounded: at most `retries` extra attempts, 50 ms .. 1 s apart, so a
        # dead server costs an I/O task about a second, never minutes.
        "retry": Retry(backoff(), cfg.retries),
        "health_check_interval": 0,
    }
    if cfg.is_cluster:
        from redis.cluster import ClusterNode, RedisCluster

        kw["max_connections"] = pool_size(cfg)
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
                kw.update(ssl=True, **_tls_kwargs(cfg))
            return RedisCluster(startup_nodes=startup, **kw)
        url, _, _ = split_credentials(cfg.effective_url)
        if urlsplit(url).scheme == "rediss":
            kw.update(_tls_kwargs(cfg))
        return RedisCluster.from_url(url, **kw)
    url, _, _ = split_credentials(cfg.effective_url)
    if urlsplit(url).scheme == "rediss":
        kw.update(_tls_kwargs(cfg))
    pool = redis.BlockingConnectionPool.from_url(
        url, max_connections=pool_size(cfg), timeout=cfg.socket_timeout_s, **kw
    )
    return redis.Redis(connection_pool=pool)


def close_client(client: Any) -> None:
    """Close ``client``; a broken one must not mask the error that got us here."""
    try:
        client.close()
    except Exception:
        logger.debug("redis tier: error closing client", exc_info=True)


#: Keys of the redis tier that name a file the TLS setup reads.
TLS_FILE_KEYS = ("tls_ca_file", "tls_cert_file", "tls_key_file")


def check_tls_files(cfg: RedisConfig) -> None:
    """Every TLS file key names a file this process can read, whatever the URL scheme:
    ConfigError naming the key and the path otherwise (redis-py would only say "No such
    file or directory" from inside its connect, naming neither)."""
    for key in TLS_FILE_KEYS:
        path = getattr(cfg, key)
        if path is None:
            continue
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
            raise ConfigError(f"redis tier: key {key!r}: cannot read {path}: {reason}") from None


def _checkout(pool: Any) -> Any:
    """One connection of ``pool``: redis-py 6 and later take no argument, 5 a command name."""
    try:
        return pool.get_connection()
    except TypeError:
        return pool.get_connection("PING")


def warm_pool(pool: Any, n: int) -> int:
    """Open ``n`` connections of ``pool`` at once, then give them all back: a fresh
    engine's first loads find them open, where a connection made on demand costs a far
    server's round trips (TCP, then redis-py's HELLO/SETINFO/SELECT tail) before its
    first command. Start-up pays about two round trips once, all connections in
    parallel. Returns how many opened; a failure only leaves that connection to be made
    on demand, as without warming (start-up's PING already said the server answers)."""
    got: list[Any] = []
    try:
        with ThreadPoolExecutor(n, thread_name_prefix="kvstore_redis_warm") as ex:
            for fut in [ex.submit(_checkout, pool) for _ in range(n)]:
                try:
                    got.append(fut.result())
                except Exception:
                    logger.debug("redis tier: warming a connection failed", exc_info=True)
    finally:
        for conn in got:
            with contextlib.suppress(Exception):
                pool.release(conn)
    return len(got)


def connect(cfg: RedisConfig, username: str | None, password: str | None, where: str) -> Any:
    """Check the TLS files, build the client and PING; raise ConfigError saying what is
    wrong at ``where``."""
    check_tls_files(cfg)
    client = None
    try:
        client = make_client(cfg, username, password)
        client.ping()
        return client
    except ConfigError:
        raise
    except rexc.AuthenticationError as exc:
        msg = (f"redis tier: authentication failed at {where}: {exc} (check 'username'/"
               f"'password' or the {cfg.password_env} environment variable)")
    except (rexc.ResponseError, rexc.AuthorizationError) as exc:
        text = str(exc)
        if "NOAUTH" in text or "AUTH" in text.upper():
            msg = (f"redis tier: the server at {where} requires a password: set 'password' "
                   f"or the {cfg.password_env} environment variable")
        else:
            msg = f"redis tier: {where} refused PING: {text}"
    except Exception as exc:  # connection refused, DNS, TLS handshake, timeout
        text = redact_text(str(exc))  # a URL parse error may quote the URL
        hint = ""
        if "SSL" in text or "ssl" in text or "certificate" in text:
            hint = (" (TLS setup: check the rediss:// URL, tls_ca_file, tls_cert_file, "
                    "tls_key_file and that the server listens with TLS on that port)")
        msg = f"redis tier: cannot connect to {where}: {type(exc).__name__}: {text}{hint}"
    if client is not None:
        close_client(client)
    raise ConfigError(msg)


# -- start-up probe ----------------------------------------------------------------
@dataclass(frozen=True)
class ServerInfo:
    """What the start-up probe learned about the server."""

    use_getex: bool = True
    maxmemory: int | None = None
    maxmemory_policy: str | None = None


def probe_server(client: Any, cfg: RedisConfig) -> ServerInfo:
    """Read version and maxmemory settings (best effort; CONFIG may be disabled)."""
    use_getex = True
    try:
        info = client.info("server")
        if cfg.is_cluster and isinstance(info, dict) and "redis_version" not in info:
            info = next(iter(info.values()), {})
        version = tuple(int(x) for x in str(info.get("redis_version", "7.0")).split(".")[:2])
        use_getex = version >= (6, 2)
    except Exception as exc:
        logger.info("redis tier: INFO server unavailable (%s); assuming Redis >= 6.2", exc)
    try:
        if cfg.is_cluster:
            per_node = client.config_get("maxmemory*", target_nodes="primaries")
            values: dict[str, Any] = (
                next(iter(per_node.values())) if per_node and isinstance(
                    next(iter(per_node.values())), dict) else per_node
            )
        else:
            values = client.config_get("maxmemory*")
    except Exception as exc:
        # Managed services (ElastiCache, Memorystore, ...) often disable CONFIG.
        logger.info(
            "redis tier: cannot read maxmemory settings (%s: %s); make sure the server "
            "evicts (maxmemory-policy allkeys-lru) so a full cache drops old blocks",
            type(exc).__name__, exc,
        )
        return ServerInfo(use_getex)
    try:
        maxmemory: int | None = int(values.get("maxmemory", 0))
    except (TypeError, ValueError):
        maxmemory = None
    return ServerInfo(use_getex, maxmemory, values.get("maxmemory-policy"))


#: (server, maxmemory, policy) this process has warned about.
_eviction_warned: set[tuple[str, int | None, str | None]] = set()


def warn_eviction(info: ServerInfo, where: str) -> None:
    """Warn about maxmemory settings that hurt a cache, once per server, settings and
    process (a command that opens the store three times says it once)."""
    seen = (where, info.maxmemory, info.maxmemory_policy)
    if seen in _eviction_warned:
        return
    _eviction_warned.add(seen)
    if info.maxmemory == 0:
        logger.warning(
            "redis tier: %s has no maxmemory limit: Redis will grow until the host runs "
            "out of memory. Set 'maxmemory <bytes>' and 'maxmemory-policy allkeys-lru'.",
            where,
        )
    elif info.maxmemory_policy == "noeviction":
        logger.warning(
            "redis tier: %s has maxmemory-policy noeviction: once maxmemory is reached "
            "every store fails (-OOM) and new blocks are not cached. Set "
            "'maxmemory-policy allkeys-lru' (CONFIG SET maxmemory-policy allkeys-lru, or "
            "in redis.conf) so Redis drops the least recently used blocks instead.",
            where,
        )
    elif info.maxmemory_policy and not info.maxmemory_policy.startswith("allkeys"):
        logger.warning(
            "redis tier: %s has maxmemory-policy %s, which only evicts keys with an "
            "expiry; without ttl_s stores fail once memory is full. Prefer allkeys-lru.",
            where, info.maxmemory_policy,
        )


# -- pipelines ---------------------------------------------------------------------
Build = Callable[[Any, Sequence[Any]], None]


def call_apart(fn: Callable[[A], R], arg: A) -> R:
    """``fn(arg)``, called from a frame that links back to none of the caller's frames.

    redis-py's cluster client keeps exceptions in reference cycles with its own
    frames (``NodesManager.initialize`` saves ``exception = e`` while it tries
    the nodes of a changed topology). A frame kept alive that way keeps its
    callers' frames alive too, through ``f_back`` once they return -- here the
    load path's, whose locals are views of vLLM's primary rows -- until the
    cyclic GC happens to run, and vLLM cannot unmap the primary at shutdown
    meanwhile. A suspended generator's frame has no ``f_back``, so such a chain
    ends at the generator below.
    """
    def apart() -> Iterator[R]:
        yield fn(arg)

    return next(apart())


def run_pipeline(client: Any, cluster: bool, build: Build, items: Sequence[Any],
                 key_of: Callable[[Any], str], per: int = 1) -> list[Any]:
    """Run ``build(pipe, items)`` (``per`` commands per item) as one pipeline.

    Returns one reply or exception per command. In cluster mode a failure
    of the whole pipeline (a dead node, a topology change) is retried as one
    pipeline per node, so keys on healthy nodes still succeed and only the
    dead node's keys carry the error. Kept exceptions are
    :func:`~kvstore_tiers.errors.detached`: their tracebacks would hold this
    frame, and through it the items (views of vLLM's primary rows).
    """
    if client is None:
        raise TransientError("redis tier is closed")

    def execute(batch: Sequence[Any]) -> list[Any]:
        pipe = client.pipeline(transaction=False)
        build(pipe, batch)
        return [detached(r) for r in pipe.execute(raise_on_error=False)]

    try:
        return call_apart(execute, items)
    except Exception as exc:
        detached(exc)  # dropped (cluster) or re-raised: never with this frame
        if not cluster or len(items) <= 1:
            raise
    by_node: dict[str, list[int]] = {}
    for i, item in enumerate(items):
        try:
            node = client.get_node_from_key(key_of(item)).name
        except Exception:
            node = "?"
        by_node.setdefault(node, []).append(i)
    out: list[Any] = [None] * (len(items) * per)
    for idxs in by_node.values():
        sub = [items[i] for i in idxs]
        try:
            replies: list[Any] = call_apart(execute, sub)
        except Exception as exc:
            replies = [detached(exc)] * (len(sub) * per)
        for j, i in enumerate(idxs):
            out[i * per : (i + 1) * per] = replies[j * per : (j + 1) * per]
    return out
