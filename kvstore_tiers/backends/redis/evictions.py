"""Keyspace events: the redis tier hears which of its blocks the server removed.

The tier's presence index answers HIT, without I/O, for a block this
process stored. Once Redis's ``maxmemory`` evicts that block (or ``ttl_s``
expires it), the HIT is stale: the promotion finds no key, the block is
counted a miss (``load_misses``) and vLLM recomputes it, and the block is
never stored again while the index holds it. No KV byte is wrong, but a
full cache pays a failed read per stale hit and loses the re-store.

Redis says which keys it evicted or expired through keyevent notifications
(``__keyevent@<db>__:evicted``, ``...:expired``). :class:`EvictionListener`
subscribes to them, on every primary of a cluster (notifications are
node-local), and hands the block keys of this tier's namespace to the
backend's eviction log (``Backend.evictions``), which the tier's presence index forgets (as it
does the fs evictor's).

Redis publishes them only when ``notify-keyspace-events`` holds ``E`` and
``e`` (and ``x`` for expiry; ``A`` stands for both). The ``eviction_events``
key (:func:`check_notifications`):

* ``auto`` (default): follow them; if the server's setting can be read and
  lacks them, log once how to enable them and follow nothing;
* ``on``: make sure: add the missing flags with ``CONFIG SET`` (on every
  node of a cluster, replicas included: a failover promotes one); a server
  that refuses (CONFIG disabled, as on managed services: set them in the
  service's parameters and use ``auto``) fails start-up naming the key;
* ``off``: no subscription.

With ``g`` as well (generic commands; ``A`` includes it), the listener also
follows ``del`` (``DEL``, ``UNLINK``, ``GETDEL``): blocks another process
removed (``kvstore-tiers gc``, a corrupt object another engine dropped) leave
the index too. A cluster's resharding ``MIGRATE`` publishes ``del`` on the
source node as well: those blocks still exist, and only go back to the
existence check. ``g`` is followed where the server has it; the tier asks for
it only through ``on`` in a cluster whose nodes differ (every node gets the
flags any node has). It makes the server publish every ``EXPIRE`` and
``GETEX`` as well (the ``ttl_s`` touches and loads).

Pub/sub delivers at most once: events sent while the listener reconnects are
lost, and those blocks' stale hits are what happens without this module (a
failed load, counted, recomputed). Nothing here decides bytes.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

import redis.exceptions as rexc

from kvstore_tiers.backends.redis.client import BACKOFF_BASE_S, BACKOFF_CAP_S
from kvstore_tiers.errors import ConfigError
from kvstore_tiers.naming import key_from_object_name
from kvstore_tiers.ratelimit import RateLimitedLogger

logger = logging.getLogger(__name__)

#: How long one wait for a message lasts: the listener's stop latency.
POLL_S = 0.5
#: How often a cluster's primaries are re-read (a failover promotes a new one).
NODES_REFRESH_S = 5.0


def wanted_flags(ttl: bool) -> str:
    """The ``notify-keyspace-events`` flags the listener needs."""
    return "Eex" if ttl else "Ee"


def missing_flags(current: str, wanted: str) -> str:
    """The flags of ``wanted`` that ``current`` lacks (``A`` includes ``e`` and ``x``)."""
    have = set(current)
    if "A" in have:
        have |= set("g$lshzxetd")
    return "".join(f for f in wanted if f not in have)


def _per_node(reply: Any, cluster: bool) -> list[str]:
    """The ``notify-keyspace-events`` value of each node in a CONFIG GET reply."""
    if cluster and isinstance(reply, dict) and reply and all(
            isinstance(v, dict) for v in reply.values()):
        nodes = list(reply.values())
    else:
        nodes = [reply]
    return [_text(n.get("notify-keyspace-events", "")) for n in nodes]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value or "")


def check_notifications(client: Any, cluster: bool, mode: str, ttl: bool, where: str
                        ) -> list[str]:
    """The keyevents to follow (``eviction_events``, module doc): none, or ``evicted``
    (``expired`` too with ``ttl``), and ``del`` where a node publishes generic events.

    Raises :class:`ConfigError` naming the key when ``mode`` is ``on`` and
    the server's setting can be neither read nor changed.
    """
    if mode == "off":
        return []
    wanted = wanted_flags(ttl)
    events = ["evicted", "expired"] if ttl else ["evicted"]
    # Replicas too: CONFIG SET is not replicated, and a failover promotes one.
    target = {"target_nodes": "all"} if cluster else {}
    try:
        current = _per_node(client.config_get("notify-keyspace-events", **target), cluster)
    except Exception as exc:
        if mode == "on":
            raise ConfigError(
                f"redis tier: eviction_events is 'on' but {where} does not let its "
                f"notify-keyspace-events be read ({type(exc).__name__}: {exc}); enable "
                f"'{wanted}' in the server's settings and use eviction_events: auto") from None
        logger.info("redis tier: cannot read notify-keyspace-events of %s (%s); following "
                    "its eviction events in case they are enabled", where, type(exc).__name__)
        return [*events, "del"]
    if any(not missing_flags(c, "g") for c in current):
        events.append("del")
    missing = {missing_flags(c, wanted) for c in current} - {""}
    if not missing:
        return events
    if mode == "auto":
        logger.info(
            "redis tier: %s does not publish eviction events (notify-keyspace-events lacks "
            "'%s'): a block Redis evicts stays a hit in this process's index until its "
            "load fails. Enable them with CONFIG SET notify-keyspace-events %s (or "
            "eviction_events: on).", where, "".join(sorted(set("".join(missing)))), wanted)
        return []
    # One value for every node: what any of them has, plus what is missing.
    have = "".join(dict.fromkeys("".join(current)))
    try:
        client.config_set("notify-keyspace-events", have + missing_flags(have, wanted),
                          **target)
    except Exception as exc:
        raise ConfigError(
            f"redis tier: eviction_events is 'on' but {where} refused CONFIG SET "
            f"notify-keyspace-events ({type(exc).__name__}: {exc}); enable '{wanted}' in "
            f"the server's settings and use eviction_events: auto") from None
    logger.info("redis tier: enabled eviction events (notify-keyspace-events +%s) on %s",
                wanted, where)
    return events


class EvictionListener:
    """Threads that follow the evicted/expired/del keyevents and report block keys.

    ``on_keys`` gets the event (``evicted``, ``expired``, ``del``) and the
    OffloadKeys of removed objects named ``key_prefix`` then an object name of
    ``namespace``, from a listener thread; other keys
    (other prefixes, namespaces, applications) are ignored. One thread per
    node: a single server, or each primary of a cluster (re-read every
    :data:`NODES_REFRESH_S`). A lost connection is retried with backoff.
    """

    def __init__(self, client: Any, cluster: bool, channels: list[str], key_prefix: str,
                 namespace: str, on_keys: Callable[[str, list[bytes]], None]) -> None:
        self._client = client
        self._cluster = cluster
        self._channels = channels
        self._strip = len(key_prefix.encode())
        self._prefix = f"{key_prefix}{namespace}/".encode()
        self._on_keys = on_keys
        self._stop = threading.Event()
        #: node name -> (its thread, its own stop: set once it is no longer a primary)
        self._threads: dict[str, tuple[threading.Thread, threading.Event]] = {}
        self._supervisor: threading.Thread | None = None
        self._warn = RateLimitedLogger(logger, interval_s=30.0)

    def start(self) -> None:
        if not self._cluster:
            self._follow("server", self._client.pubsub)
            return
        self._refresh_nodes()
        self._supervisor = threading.Thread(target=self._supervise, daemon=True,
                                            name="kvstore-redis-evictions-nodes")
        self._supervisor.start()

    def stop(self) -> None:
        """Stop every thread (each within :data:`POLL_S` of its wait); idempotent."""
        self._stop.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=POLL_S * 4)  # it starts no thread after this
        for t, _ in list(self._threads.values()):
            if t is not threading.current_thread():
                t.join(timeout=POLL_S * 4)

    def _supervise(self) -> None:
        while not self._stop.wait(NODES_REFRESH_S):
            try:
                self._refresh_nodes()
            except Exception as exc:
                self._warn.warning("nodes", "redis tier: reading the cluster's primaries "
                                   "for eviction events failed: %s", exc)

    def _refresh_nodes(self) -> None:
        primaries = {node.name: node for node in self._client.get_primaries()}
        for name in [n for n in self._threads if n not in primaries]:
            self._threads.pop(name)[1].set()  # demoted or gone: its events come from elsewhere
        for name, node in primaries.items():
            entry = self._threads.get(name)
            if entry is None or not entry[0].is_alive():
                conn = self._client.get_redis_connection(node)
                self._follow(name, conn.pubsub)

    def _follow(self, name: str, make_pubsub: Callable[..., Any]) -> None:
        own = threading.Event()
        thread = threading.Thread(target=self._run, args=(name, make_pubsub, own),
                                  daemon=True, name=f"kvstore-redis-evictions-{name}")
        self._threads[name] = (thread, own)
        thread.start()

    def _run(self, name: str, make_pubsub: Callable[..., Any], own: threading.Event) -> None:
        delay = BACKOFF_BASE_S
        stopped = lambda: self._stop.is_set() or own.is_set()  # noqa: E731
        while not stopped():
            pubsub = None
            try:
                pubsub = make_pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(*self._channels)
                delay = BACKOFF_BASE_S
                while not stopped():
                    message = pubsub.get_message(timeout=POLL_S)
                    if message is not None and message.get("type") == "message":
                        self._received(message["channel"], message["data"])
            except rexc.ResponseError as exc:
                # Refused, not lost (an ACL user without these channels): no retry loop.
                logger.warning("redis tier: %s refuses the eviction events' channels (%s); "
                               "not following them (grant the user &__keyevent@* or set "
                               "eviction_events: off)", name, exc)
                return
            except Exception as exc:
                self._warn.warning(f"listen-{name}", "redis tier: following eviction events "
                                   "of %s failed (%s); retrying", name, type(exc).__name__)
                self._stop.wait(delay)
                delay = min(delay * 2, BACKOFF_CAP_S)
            finally:
                if pubsub is not None:
                    with contextlib.suppress(Exception):  # a dead connection: nothing to free
                        pubsub.close()

    def _received(self, channel: Any, data: Any) -> None:
        if not isinstance(data, bytes) or not data.startswith(self._prefix):
            return
        key = key_from_object_name(data[self._strip:].decode("ascii", "replace"))
        if key is not None:
            self._on_keys(_text(channel).rpartition(":")[2], [key])
