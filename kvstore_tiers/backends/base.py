"""The backend interface: put, get, check and delete bytes.

A backend knows nothing of vLLM, rows, codecs or threads. The core
(:mod:`kvstore_tiers.tier`) hands it object names (from
:meth:`Namespace.object_name`) and whole frames, from its I/O threads, and
turns the backend's three kinds of error (:mod:`kvstore_tiers.errors`) into
misses and failed jobs. A new backend is one module: subclass
:class:`Backend`, declare a :class:`~kvstore_tiers.config.TierConfig`
subclass with its keys, and register it under the
``kvstore_tiers.backends`` entry-point group.

Contract of the data methods (called concurrently from several threads):

* ``put(name, parts)`` stores the concatenation of ``parts`` under ``name``
  so that it becomes visible atomically (never a torn or half-written
  object). It returns ``False`` when the object already existed and was left
  alone, ``True`` when written.
* ``get(name)`` returns the whole object or raises ObjectMissing.
* ``exists_many(names)`` returns one bool per name, in order.
* ``delete(name)`` removes an object; a missing one is not an error.
* ``iter_objects(prefix)`` yields :class:`ObjectInfo` for administration.

``store_many``/``load_many`` are the batched entry points the core calls,
with at most ``max_store_batch`` (stores; ``max_batch`` if None) or
``max_batch`` (loads; fewer with ``spread_loads``) items; the defaults loop
over ``store_one``/``load_one``, which a backend may override for zero-copy
paths (fs) and batches override for pipelining (redis) or one call per
batch (fs).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from kvstore_tiers.config import TierConfig
from kvstore_tiers.errors import BackendError, TransientError

if TYPE_CHECKING:
    from kvstore_tiers.frame import FrameCodec
    from kvstore_tiers.namespace import Namespace

Buffer = bytes | bytearray | memoryview


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
    #: Set by the store path: bytes of the frame sent to the backend.
    stored_len: int = 0


@dataclass(slots=True)
class LoadItem:
    """One row to load: object ``name`` of block ``key`` into ``dest``."""

    name: str
    key: bytes
    dest: memoryview
    #: Set by the load path: bytes of the frame received from the backend.
    stored_len: int = 0


class Backend(ABC):
    """Abstract byte store. Subclasses set the class attributes and data methods."""

    #: Name under which the backend is registered (the tier ``type``).
    name: ClassVar[str]
    #: pydantic model of the tier's config keys (a TierConfig subclass).
    config_model: ClassVar[type[TierConfig]] = TierConfig
    #: True for network backends: drives compression=auto, default locality, backpressure.
    remote: ClassVar[bool] = False
    #: Alignment of frame headers written by this backend.
    header_align: ClassVar[int] = 8
    #: Chunks handed to one I/O task (batching for pipelined backends).
    max_batch: ClassVar[int] = 1
    #: Chunks handed to one *store* task; None: ``max_batch``. Stores only
    #: need to finish, not to start at once, so a backend may take them in
    #: larger batches than loads, which sit on time-to-first-token.
    max_store_batch: ClassVar[int | None] = None
    #: Spread a load job over every read thread before filling batches: a
    #: 16-chunk load on 8 threads goes 2 chunks per task, not ``max_batch``
    #: (fs: each file is its own read, so threads are what makes them
    #: parallel; redis/s3 overlap a batch's requests within one task).
    spread_loads: ClassVar[bool] = False
    #: At most this many bytes of rows per load task (at least one row; None:
    #: no bound), so a task's latency stays about one large read.
    max_load_batch_bytes: ClassVar[int | None] = None
    #: ``delete_many`` is one native batch (not the default loop over ``delete``).
    supports_delete_many: ClassVar[bool] = False

    def __init__(self, config: Any, namespace: Namespace) -> None:
        self.config = config
        self.namespace = namespace
        #: Objects this backend removed for capacity (eviction), for metrics.
        self.evicted_objects = 0

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
    def put(self, name: str, parts: Sequence[Buffer]) -> bool: ...

    @abstractmethod
    def get(self, name: str) -> Buffer: ...

    @abstractmethod
    def exists_many(self, names: Sequence[str]) -> list[bool]: ...

    @abstractmethod
    def delete(self, name: str) -> None: ...

    @abstractmethod
    def iter_objects(self, prefix: str = "") -> Iterator[ObjectInfo]: ...

    def delete_many(self, names: Sequence[str]) -> None:
        """Remove every object of ``names``; missing ones are not an error.

        The default loops over :meth:`delete`; a backend with a batch delete
        overrides it and sets ``supports_delete_many``.
        """
        for name in names:
            self.delete(name)

    def touch_many(self, names: Sequence[str]) -> None:  # noqa: B027 - optional hook
        """Refresh recency/expiry of objects (LRU, TTL). Best effort."""

    # -- frames (what the core calls) -------------------------------------------
    def store_one(self, item: StoreItem, codec: FrameCodec) -> bool:
        header, payload = codec.encode(item.key, item.src)
        item.stored_len = len(header) + len(payload)
        return self.put(item.name, (header, payload))

    def load_one(self, item: LoadItem, codec: FrameCodec) -> None:
        frame = self.get(item.name)
        item.stored_len = len(frame)
        codec.decode_into(item.key, frame, item.dest)

    def store_many(
        self, items: Sequence[StoreItem], codec: FrameCodec
    ) -> list[bool | BaseException]:
        """Store every item; per item ``True``/``False`` (written/existed) or the error."""
        out: list[bool | BaseException] = []
        for item in items:
            try:
                out.append(self.store_one(item, codec))
            except Exception as exc:
                out.append(classify(exc))
        return out

    def load_many(
        self, items: Sequence[LoadItem], codec: FrameCodec
    ) -> list[BaseException | None]:
        """Load every item; per item ``None`` on success or the error."""
        out: list[BaseException | None] = []
        for item in items:
            try:
                self.load_one(item, codec)
                out.append(None)
            except Exception as exc:
                out.append(classify(exc))
        return out


def encode_batch(
    items: Sequence[StoreItem], codec: FrameCodec,
    classify_error: Callable[[BaseException], BaseException] | None = None,
) -> tuple[list[Any], list[tuple[int, bytearray, Buffer]]]:
    """Encode every item's row into a frame, on the calling (pool) thread.

    For batched ``store_many`` implementations. Returns ``(out, encoded)``:
    ``out`` has one slot per item -- the classified error where encoding
    failed, a "not attempted" TransientError placeholder elsewhere, for the
    caller to overwrite with that item's result -- and ``encoded`` lists
    ``(index, header, payload)`` of the items that encoded. Sets each encoded
    item's ``stored_len``.
    """
    classify_error = classify_error or classify
    out: list[Any] = [TransientError("not attempted")] * len(items)
    encoded: list[tuple[int, bytearray, Buffer]] = []
    for i, item in enumerate(items):
        try:
            header, payload = codec.encode(item.key, item.src)
        except Exception as exc:
            out[i] = classify_error(exc)
            continue
        item.stored_len = len(header) + len(payload)
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
