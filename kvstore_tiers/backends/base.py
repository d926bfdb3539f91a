"""The backend interface: put, get, check and delete bytes.

A backend knows nothing of vLLM, rows, codecs or threads. The core hands it
object names (from :meth:`Namespace.object_name`) and whole frames, from its
I/O threads, and turns the backend's three kinds of error
(:mod:`kvstore_tiers.errors`) into misses and failed jobs. A new backend is
one module: subclass :class:`Backend`, declare a
:class:`~kvstore_tiers.config.TierConfig` subclass with its keys, register it
under the ``kvstore_tiers.backends`` entry-point group, and subclass
:class:`kvstore_tiers.testing.backend.BackendTests` in its tests.

Contract of the data methods (called concurrently from several threads):

* ``put(name, parts)`` stores the concatenation of ``parts`` under ``name``
  so that it becomes visible atomically (never a torn or half-written
  object). It returns ``False`` when the object already existed and was left
  alone, ``True`` when written.
* ``get(name)`` returns the whole object or raises ObjectMissing.
* ``exists_many(names)`` returns one bool per name, in order.
* ``delete(name)`` removes an object; a missing one is not an error.
* ``iter_objects(prefix)`` yields :class:`ObjectInfo` for administration.

Optional capabilities, each declared by a ``supports_*`` flag (the core reads
the flags, never compares methods): ``delete_many`` (one native batch;
default: a loop over ``delete``), ``touch_many`` (refresh LRU/TTL; default:
nothing), ``read_into`` (a zero-copy load of one frame, header first,
through :meth:`FrameCodec.receive`) and ``capacity_usage`` (bytes used and
allowed: the signal of ``admission: adaptive``).

``store_many``/``load_many`` are the batched entry points the core calls,
with at most ``tuning.store_batch`` / ``tuning.load_batch`` items; the
defaults loop over ``put`` (``read_into`` or ``get``) through the
:class:`~kvstore_tiers.frame.FrameCodec`, and a backend overrides them for
pipelining (redis, s3) or one call per batch (fs). Both RETURN one result per
item, in order, and never raise: the frame bytes moved (stores: 0 when the
object already existed), or the item's error.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from kvstore_tiers.config import TierConfig
from kvstore_tiers.errors import BackendError, TransientError
from kvstore_tiers.namespace import key_from_object_name

if TYPE_CHECKING:
    from kvstore_tiers.frame import FrameCodec
    from kvstore_tiers.namespace import Namespace

Buffer = bytes | bytearray | memoryview

#: Evicted keys a backend holds for its tier to take (:attr:`Backend.evicted_keys`).
EVICTED_KEYS_MAX = 1 << 16


@dataclass(frozen=True, slots=True)
class IOTuning:
    """How the I/O pool batches one backend's work: the pool's tuning in one value.

    Read once by the core when the tier starts (:attr:`Backend.tuning`).
    """

    #: Chunks per load task (a pipeline's worth for a remote backend).
    load_batch: int = 1
    #: Chunks per store task. Stores only need to finish, not to start at
    #: once, so a backend may take them in larger batches than loads, which
    #: sit on time-to-first-token.
    store_batch: int = 1
    #: Spread a load job over every read thread before filling batches: a
    #: 16-chunk load on 8 threads goes 2 chunks per task, not ``load_batch``
    #: (fs: each file is its own read, so threads are what makes them
    #: parallel; redis/s3 overlap a batch's requests within one task).
    spread_loads: bool = False
    #: At most this many bytes of rows per load task (at least one row; None:
    #: no bound), so a task's latency stays about one large read.
    max_load_batch_bytes: int | None = None
    #: Alignment the frame headers this backend writes are padded to.
    header_align: int = 8


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """One stored object, as listed by :meth:`Backend.iter_objects`."""

    name: str
    size: int
    mtime: float


@dataclass(slots=True)
class StoreItem:
    """One row to store: object ``name`` of block ``key`` from ``src``."""

    name: str
    key: bytes
    src: memoryview


@dataclass(slots=True)
class LoadItem:
    """One row to load: object ``name`` of block ``key`` into ``dest``."""

    name: str
    key: bytes
    dest: memoryview


#: One item's result from ``store_many``/``load_many``: frame bytes moved
#: (stores: 0 = the object existed already) or the item's error.
Result = int | BaseException


class Backend(ABC):
    """Abstract byte store. Subclasses set the class attributes and data methods."""

    #: Name under which the backend is registered (the tier ``type``).
    name: ClassVar[str]
    #: pydantic model of the tier's config keys (a TierConfig subclass).
    config_model: ClassVar[type[TierConfig]] = TierConfig
    #: True for network backends: drives compression=auto, default locality, backpressure.
    remote: ClassVar[bool] = False
    #: Objects outlive this instance (a restarted engine or another process reads them);
    #: False for an in-process store whose objects go with its engine.
    persistent: ClassVar[bool] = True
    #: ``delete_many`` is one native batch (not the default loop over ``delete``).
    supports_delete_many: ClassVar[bool] = False
    #: ``touch_many`` does something (LRU / TTL refresh): the core sends it touches.
    supports_touch: ClassVar[bool] = False
    #: ``read_into`` is implemented (a zero-copy load path).
    supports_read_into: ClassVar[bool] = False
    #: ``capacity_usage`` can tell how full the store is (adaptive admission's signal).
    supports_capacity: ClassVar[bool] = False

    def __init__(self, config: Any, namespace: Namespace) -> None:
        self.config = config
        self.namespace = namespace
        #: Objects this backend removed for capacity (eviction), or its server
        #: evicted or expired, for metrics.
        self.evicted_objects = 0
        #: Of those, the ones removed because the store was full (not expired):
        #: adaptive admission counts a tier that evicted lately as full.
        self.evicted_for_capacity = 0
        #: Keys of objects evicted by this backend (fs ``max_bytes``) or its
        #: server (redis ``maxmemory``, ``ttl_s``), appended by its threads
        #: through :meth:`note_evicted`, taken by the tier: its presence index
        #: forgets them instead of answering HIT for a block that is gone.
        #: Bounded: past it the oldest are dropped (those keys' next loads
        #: fail and are recomputed, as for an object another process removed).
        self.evicted_keys: deque[bytes] = deque(maxlen=EVICTED_KEYS_MAX)
        self._evicted_lock = threading.Lock()

    def note_evicted(self, objects: int, keys: Iterable[bytes], for_capacity: bool = True) -> None:
        """Record ``objects`` objects the store removed for capacity (or its server
        evicted or, ``for_capacity`` False, expired), ``keys`` the block keys among
        them: the count goes to ``evicted_objects`` (and ``evicted_for_capacity``),
        the keys to ``evicted_keys``. Safe from several threads."""
        with self._evicted_lock:  # several threads may report (one per cluster primary)
            self.evicted_objects += objects
            if for_capacity:
                self.evicted_for_capacity += objects
        self.evicted_keys.extend(keys)

    def note_evicted_names(self, names: Sequence[str]) -> None:
        """:meth:`note_evicted` for objects removed for capacity, given by their
        names (or paths ending in one): the keys are read back from the names."""
        self.note_evicted(len(names), [k for k in map(key_from_object_name, names)
                                       if k is not None])

    @property
    def tuning(self) -> IOTuning:
        """How the pool batches this backend's work (may depend on its config)."""
        return IOTuning()

    # -- lifecycle -------------------------------------------------------------
    def open(self) -> None:  # noqa: B027 - optional hook
        """Connect and probe; raise ConfigError/RuntimeError with a clear message."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and threads. Idempotent."""

    def describe(self) -> str:
        """One line saying where the data lives. Must not contain secrets."""
        return self.name

    # -- bytes -----------------------------------------------------------------
    @abstractmethod
    def put(self, name: str, parts: Sequence[Buffer]) -> bool:
        """Atomically store ``parts`` back to back as ``name``; False if it existed (left alone)."""

    @abstractmethod
    def get(self, name: str) -> Buffer:
        """The whole object ``name``; raises ObjectMissing if there is none."""

    @abstractmethod
    def exists_many(self, names: Sequence[str]) -> list[bool]:
        """One bool per name, in order."""

    @abstractmethod
    def delete(self, name: str) -> None:
        """Remove ``name``; a missing object is not an error."""

    @abstractmethod
    def iter_objects(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose name starts with ``prefix`` (administration)."""

    # -- optional (declared by the supports_* flags) --------------------------------
    def delete_many(self, names: Sequence[str]) -> None:
        """Remove every name (missing ones are not an error). Default: ``delete`` each."""
        for name in names:
            self.delete(name)

    def touch_many(self, names: Sequence[str]) -> None:  # noqa: B027 - optional hook
        """Refresh recency/expiry of objects (LRU, TTL). Best effort; default: nothing."""

    def sweep_temp_files(self) -> int:
        """Remove what writers killed mid-write left behind (fs: their temp
        files), never what a live writer still owns; returns how many. Called
        at start and by ``gc``. Default: nothing (a store whose writes are
        atomic server-side, as S3's PutObject and Redis' SET, leaves nothing)."""
        return 0

    def capacity_usage(self) -> tuple[int, int] | None:
        """(bytes used, bytes allowed) of this tier's store, or None where it is not
        bounded (or cannot tell now). Only with ``supports_capacity``.

        Called every fraction of a second from the admission probe thread, never
        from the scheduler thread; may do I/O (one small request), may raise."""
        return None

    def object_bytes(self) -> int | None:
        """What one object of this tier adds to the bytes used that
        :meth:`capacity_usage` reports, where that is not its frame's size
        (redis: the key's memory on the server, its name and bookkeeping
        included); None: the frame's size. Only with ``supports_capacity``.

        Called from the admission probe thread with :meth:`capacity_usage`;
        may do I/O (one small request), may raise."""
        return None

    def read_into(self, item: LoadItem, codec: FrameCodec) -> int:
        """Load one frame into ``item.dest``: its header first, then the payload
        straight into the row (:meth:`FrameCodec.receive`); returns the frame's
        size. Raises the item's error. Only with ``supports_read_into``."""
        raise NotImplementedError(f"{type(self).__name__} does not support read_into")

    # -- frames (what the core calls) -------------------------------------------
    def store_many(self, items: Sequence[StoreItem], codec: FrameCodec) -> list[Result]:
        """Store every item; per item the frame bytes written, 0 if it existed, or the error."""
        out: list[Result] = []
        for item in items:
            try:
                header, payload = codec.encode(item.key, item.src)
                written = self.put(item.name, (header, payload))
                out.append(len(header) + len(payload) if written else 0)
            except Exception as exc:
                out.append(classify(exc))
        return out

    def load_many(self, items: Sequence[LoadItem], codec: FrameCodec) -> list[Result]:
        """Load every item into its row; per item the frame bytes received or the error."""
        out: list[Result] = []
        direct = type(self).supports_read_into
        for item in items:
            try:
                if direct:
                    out.append(self.read_into(item, codec))
                else:
                    frame = self.get(item.name)
                    codec.decode_into(item.key, frame, item.dest)
                    out.append(len(frame))
            except Exception as exc:
                out.append(classify(exc))
        return out


def encode_batch(
    items: Sequence[StoreItem], codec: FrameCodec,
    classify_error: Callable[[BaseException], BaseException] | None = None,
) -> tuple[list[Result], list[tuple[int, bytearray, Buffer]]]:
    """Encode every item's row into a frame, on the calling (pool) thread.

    For batched ``store_many`` implementations. Returns ``(out, encoded)``:
    ``out`` has one slot per item -- the classified error where encoding
    failed, a "not attempted" TransientError placeholder elsewhere, for the
    caller to overwrite with that item's result -- and ``encoded`` lists
    ``(index, header, payload)`` of the items that encoded.
    """
    classify_error = classify_error or classify
    out: list[Result] = [TransientError("not attempted")] * len(items)
    encoded: list[tuple[int, bytearray, Buffer]] = []
    for i, item in enumerate(items):
        try:
            header, payload = codec.encode(item.key, item.src)
        except Exception as exc:
            out[i] = classify_error(exc)
            continue
        encoded.append((i, header, payload))
    return out, encoded


def classify(exc: BaseException) -> BaseException:
    """Map an arbitrary exception onto the backend error kinds.

    ObjectMissing/ObjectCorrupt/TransientError pass through; anything else
    (a bug, an unexpected client error) counts as transient, so it fails the
    job without declaring the object corrupt.
    """
    if isinstance(exc, BackendError):
        return exc
    err = TransientError(f"{type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err
