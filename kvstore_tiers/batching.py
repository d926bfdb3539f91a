"""Batches of frames: what the I/O pool hands a backend, and the default loops.

The core moves a job's slots a batch at a time (``IOTuning.store_batch`` /
``load_batch`` items). :func:`store_many` and :func:`load_many` are its one
entry point: a backend that declares ``supports_batches`` does a batch its
own way (pipelined redis and s3 requests, one GIL-free fs call); any other
gets the default loop here, over ``put`` and ``get`` (or ``read_into``)
through the :class:`~kvstore_tiers.frame.FrameCodec`. Either way the result
is one entry per item, in order, and nothing raises: the frame bytes moved
(stores: 0 when the object already existed), or the item's error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING

from kvstore_tiers.backends.base import LoadMany, Result, StoreMany
from kvstore_tiers.errors import TransientError, classify

if TYPE_CHECKING:
    from kvstore_tiers.backends.base import Backend, Buffer, LoadItem, StoreItem
    from kvstore_tiers.frame import FrameCodec


def batch_calls(backend: Backend) -> tuple[StoreMany, LoadMany]:
    """The calls that store and load a batch on ``backend``, chosen once: its own
    (``supports_batches``), so a job calls the backend with nothing between,
    or the default loops below bound to it."""
    if backend.supports_batches:
        return backend.store_many, backend.load_many
    return partial(store_many, backend), partial(load_many, backend)


def store_many(backend: Backend, items: Sequence[StoreItem], codec: FrameCodec
               ) -> list[Result]:
    """Store every item; per item the frame bytes written, 0 if it existed, or the error."""
    if backend.supports_batches:
        return backend.store_many(items, codec)
    out: list[Result] = []
    for item in items:
        try:
            header, payload = codec.encode(item.key, item.src, item.crc)
            written = backend.put(item.name, (header, payload))
            out.append(len(header) + len(payload) if written else 0)
        except Exception as exc:
            out.append(classify(exc))
    return out


def load_many(backend: Backend, items: Sequence[LoadItem], codec: FrameCodec
              ) -> list[Result]:
    """Load every item into its row; per item the frame bytes received or the error."""
    if backend.supports_batches:
        return backend.load_many(items, codec)
    out: list[Result] = []
    direct = backend.supports_read_into
    for item in items:
        try:
            if direct:
                out.append(backend.read_into(item, codec))
            else:
                frame = backend.get(item.name)
                item.crc = codec.decode_into(item.key, frame, item.dest).row_checksum
                out.append(len(frame))
        except Exception as exc:
            out.append(classify(exc))
    return out


def encode_batch(
    items: Sequence[StoreItem], codec: FrameCodec,
    classify_error: Callable[[BaseException], BaseException] | None = None,
    unsummed: bool = False,
) -> tuple[list[Result], list[tuple[int, bytearray, Buffer]]]:
    """Encode every item's row into a frame, on the calling (pool) thread;
    ``unsummed``: an item without a known ``crc`` is left for the writer to
    checksum (:meth:`FrameCodec.encode`).

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
            header, payload = codec.encode(item.key, item.src, item.crc, unsummed=unsummed)
        except Exception as exc:
            out[i] = classify_error(exc)
            continue
        encoded.append((i, header, payload))
    return out, encoded
