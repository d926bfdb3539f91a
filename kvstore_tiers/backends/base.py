"""The backend contract: put, get, check and delete bytes.

A backend knows nothing of vLLM, rows, frames or threads. The core hands it
object names (:mod:`kvstore_tiers.naming`) and buffers, from its I/O
threads, and turns the backend's three kinds of error
(:mod:`kvstore_tiers.errors`) into misses and failed jobs. What the bytes
mean (a frame: header, payload, checksum) is the core's alone
(:mod:`kvstore_tiers.frame`, :mod:`kvstore_tiers.batching`). A new backend is
one package: subclass :class:`Backend`, declare a
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
* ``write_many(writes)`` is a gather write of a batch (:class:`Write`): per
  write, the bytes written, 0 if the object existed, or the error; it never
  raises. Default: ``put`` each.
* ``read_many(reads)`` is a scatter read of a batch (:class:`Read`): each
  object's bytes from its start into the caller's buffers, in order; per
  read ``(index, (bytes placed, object size, crc))`` or ``(index, error)``,
  as each read completes (in any order); it never raises. A backend whose
  transport hands it an object whole (an HTTP body, a pipeline's reply) may
  give ``(index, that buffer)`` instead of copying it into the buffers: the
  core then decodes from it. Default: ``get`` each, given whole.

A backend overrides ``write_many``/``read_many`` only to move the bytes its
own way (pipelined requests, requests in flight at once, one GIL-free call);
what is read or written, and the batch sizes, are the core's.

Optional capabilities, each declared by a ``supports_*`` flag with its
methods (the core reads the flags, never compares methods):
``delete_many`` (one native batch; default: a loop over ``delete``),
``touch_many`` (refresh LRU/TTL; default: nothing), ``crc32c`` (the reads
and writes compute the CRC-32C of one buffer while its bytes pass: see
:class:`Read` and :class:`Write`), and ``capacity_usage``/``object_bytes``
(how full the store is: the signal of ``admission: adaptive``). A store that
evicts on its own reports it through its :attr:`Backend.evictions` log
(:mod:`kvstore_tiers.backends.eviction_log`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from kvstore_tiers.config import TierConfig
from kvstore_tiers.errors import classify

if TYPE_CHECKING:
    from kvstore_tiers.backends.eviction_log import EvictionLog

Buffer = bytes | bytearray | memoryview


#: Bytes of an object's start that a listing of a store keeping no write time
#: returns in :attr:`ObjectInfo.head`, for the core to read the time from.
LISTING_HEAD = 64


@dataclass(slots=True)
class Write:
    """One object to write: ``parts`` back to back as ``name``.

    ``crc``: ``(i, at)`` asks a backend that ``supports_crc32c`` to compute the
    CRC-32C of ``parts[i]`` while writing it and to write it, as 4 bytes
    little-endian, at offset ``at`` of the object (within ``parts[0]``, whose
    own 4 bytes there are ignored; the bytes after them are written as they
    are), before the object becomes visible; None: the bytes are written as
    they are. The core asks only a backend with the capability."""

    name: str
    parts: Sequence[Buffer]
    crc: tuple[int, int] | None = None


@dataclass(slots=True)
class Read:
    """One object to read: its bytes, from its start, into ``parts`` in order.

    ``crc_part``: the index of the buffer whose CRC-32C a backend that
    ``supports_crc32c`` computes as its bytes land (None: no checksum asked)."""

    name: str
    parts: Sequence[memoryview]
    crc_part: int | None = None


#: What one read gave: (bytes placed into the parts, the object's whole size,
#: the CRC-32C of the asked part or None). ``placed`` is ``min(size,
#: capacity of the parts)``: an object longer than the parts fills them and
#: the rest is not read. The crc is given only when that part was filled whole.
Placed = tuple[int, int, int | None]
#: A write's result: bytes written (0: the object existed and was left
#: alone), or the write's error.
Written = int | BaseException
#: A read's result as :meth:`Backend.read_many` yields it: the read's index
#: in the batch and what it placed, or the whole object (a buffer the
#: backend was handed, not copied into the parts), or its error.
ReadDone = tuple[int, Placed | Buffer | BaseException]


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
    """One stored object, as listed by :meth:`Backend.iter_objects`.

    ``mtime``: when it was written, in seconds since the epoch; None where the
    store keeps no write time, and then ``head`` holds the object's first
    :data:`LISTING_HEAD` bytes (fewer for a shorter object), from which the
    core reads the time its writer recorded."""

    name: str
    size: int
    mtime: float | None
    head: bytes | None = None


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
    #: ``read_many``/``write_many`` compute a CRC-32C where a Read or Write asks.
    supports_crc32c: ClassVar[bool] = False
    #: ``capacity_usage`` can tell how full the store is (adaptive admission's signal).
    supports_capacity: ClassVar[bool] = False
    #: What the store removed on its own, where it evicts (set by the backend,
    #: at latest in :meth:`open`); None: it never evicts.
    evictions: EvictionLog | None = None

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

    def write_many(self, writes: Sequence[Write]) -> list[Written]:
        """Write every object; per write the bytes written, 0 if it existed, or
        its error (classified: :func:`kvstore_tiers.errors.classify`); never
        raises. Default: ``put`` each (a backend without ``supports_crc32c`` is
        never asked for a crc)."""
        out: list[Written] = []
        for w in writes:
            try:
                out.append(sum(len(p) for p in w.parts) if self.put(w.name, w.parts) else 0)
            except Exception as exc:
                out.append(classify(exc))
        return out

    def read_many(self, reads: Sequence[Read]) -> Iterable[ReadDone]:
        """Read every object into its parts; yields ``(index, (placed, size,
        crc))``, ``(index, the whole object)`` or ``(index, error)`` once per
        read, as each completes, in any order; never raises (an error of the
        whole batch is every read's). Default: ``get`` each, given whole."""
        for i, r in enumerate(reads):
            try:
                yield i, self.get(r.name)
            except Exception as exc:
                yield i, classify(exc)
