"""The backend contract: put, get, check and delete bytes.

A backend knows nothing of vLLM, rows or threads. The core hands it object
names (:mod:`kvstore_tiers.naming`) and whole frames, from its I/O threads,
and turns the backend's three kinds of error (:mod:`kvstore_tiers.errors`)
into misses and failed jobs. A new backend is one package: subclass
:class:`Backend`, declare a :class:`~kvstore_tiers.config.TierConfig`
subclass with its keys, register it under the ``kvstore_tiers.backends``
entry-point group, and subclass
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

Optional capabilities, each declared by a ``supports_*`` flag with its
methods (the core reads the flags, never compares methods):
``delete_many`` (one native batch; default: a loop over ``delete``),
``touch_many`` (refresh LRU/TTL; default: nothing), ``read_into`` (a
zero-copy load of one frame through :meth:`FrameCodec.receive`),
``store_many``/``load_many`` (a batch done natively: pipelined requests,
one GIL-free call; the default loops are the core's,
:mod:`kvstore_tiers.batching`) and ``capacity_usage``/``object_bytes`` (how
full the store is: the signal of ``admission: adaptive``). A store that
evicts on its own reports it through its :attr:`Backend.evictions` log
(:mod:`kvstore_tiers.backends.eviction_log`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from kvstore_tiers.config import TierConfig

if TYPE_CHECKING:
    from kvstore_tiers.backends.eviction_log import EvictionLog
    from kvstore_tiers.frame import FrameCodec

Buffer = bytes | bytearray | memoryview


@dataclass(slots=True)
class StoreItem:
    """One row to store: object ``name`` of block ``key`` from ``src``.

    ``crc``: the CRC-32C of ``src``, when the caller computed it over these very
    bytes (a read-through fill); the frame then takes it instead of computing
    it again."""

    name: str
    key: bytes
    src: memoryview
    crc: int | None = None


@dataclass(slots=True)
class LoadItem:
    """One row to load: object ``name`` of block ``key`` into ``dest``.

    ``crc``: set by the backend once the row is verified, to what the frame
    checks answer (:meth:`FrameReceiver.finish
    <kvstore_tiers.frame.FrameReceiver.finish>`): the row's CRC-32C, or None
    where the frame carries none (encrypted) or the backend does not say."""

    name: str
    key: bytes
    dest: memoryview
    crc: int | None = None


#: One item's result from ``store_many``/``load_many``: frame bytes moved
#: (stores: 0 = the object existed already) or the item's error.
Result = int | BaseException


#: A batch call: items and the thread's codec in, one result per item out.
StoreMany = Callable[[Sequence["StoreItem"], "FrameCodec"], list["Result"]]
LoadMany = Callable[[Sequence["LoadItem"], "FrameCodec"], list["Result"]]


class StoreNamespace(Protocol):
    """What a backend knows of the namespace: its name (the first part of
    every object name) and the run config it may record beside the objects."""

    name: str
    run_config: Mapping[str, Any]


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
    #: ``store_many``/``load_many`` do a batch natively (else the core's loops).
    supports_batches: ClassVar[bool] = False
    #: What the store removed on its own, where it evicts (set by the backend,
    #: at latest in :meth:`open`); None: it never evicts.
    evictions: EvictionLog | None = None
    #: With the load trace on (:mod:`kvstore_tiers.loadtrace`), set by the
    #: core: ``trace_mark(stage)`` inside ``load_many`` notes that ``stage``
    #: happened now; None (off) a backend marks nothing.
    trace_mark: Callable[[str], None] | None = None

    def __init__(self, config: Any, namespace: StoreNamespace) -> None:
        self.config = config
        self.namespace = namespace

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

    def store_many(self, items: Sequence[StoreItem], codec: FrameCodec) -> list[Result]:
        """Encode and store every item as one native batch; per item the frame
        bytes written, 0 if it existed, or the error; never raises. Only with
        ``supports_batches`` (:func:`kvstore_tiers.batching.store_many`)."""
        raise NotImplementedError(f"{type(self).__name__} does not support batches")

    def load_many(self, items: Sequence[LoadItem], codec: FrameCodec) -> list[Result]:
        """Load every item into its row as one native batch; per item the frame
        bytes received or the error; never raises. Only with ``supports_batches``
        (:func:`kvstore_tiers.batching.load_many`)."""
        raise NotImplementedError(f"{type(self).__name__} does not support batches")
