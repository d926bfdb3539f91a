"""Batches of rows: what a job's I/O thread moves, as frames, through a backend.

The core moves a job's slots a batch at a time (``IOTuning.store_batch`` /
``load_batch`` items). :func:`store_many` and :func:`load_many` are its one
entry point, and the only place where rows meet the backend contract
(:mod:`kvstore_tiers.backends.base`): a store encodes each row into a frame
and hands the backend a gather write (:class:`~kvstore_tiers.backends.base.Write`);
a load plans each frame as a scatter read into the row
(:meth:`FrameCodec.plan_reads <kvstore_tiers.frame.FrameCodec.plan_reads>`),
hands the backend the reads, and checks and decodes each frame as its read
completes (from the planned buffers, or from the whole object where the
backend's transport handed it one). The backend only moves bytes (its batch its own way: pipelined
requests, requests in flight at once, one GIL-free call). Either way the
result is one entry per item, in order, and nothing raises: the frame bytes
moved (stores: 0 when the object already existed), or the item's error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore_tiers.backends.base import Read, Write
from kvstore_tiers.errors import TransientError, classify
from kvstore_tiers.frame import CHECKSUM_AT, Unplanned

if TYPE_CHECKING:
    from kvstore_tiers.backends.base import Backend
    from kvstore_tiers.frame import FrameCodec


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

    ``crc``: set by :func:`load_many` once the row is verified, to what the
    frame's checks answer: the row's CRC-32C, or None where the frame carries
    none (encrypted)."""

    name: str
    key: bytes
    dest: memoryview
    crc: int | None = None


#: One item's result from :func:`store_many`/:func:`load_many`: frame bytes
#: moved (stores: 0 = the object existed already) or the item's error.
Result = int | BaseException
#: A batch call bound to its backend: items and the thread's codec in, one
#: result per item out.
StoreMany = Callable[[Sequence[StoreItem], "FrameCodec"], list[Result]]
LoadMany = Callable[[Sequence[LoadItem], "FrameCodec"], list[Result]]
#: ``mark(stage)``: the load trace notes that ``stage`` happened now
#: (:meth:`kvstore_tiers.loadtrace.LoadTrace.mark`).
Mark = Callable[[str], None]


def store_many(backend: Backend, items: Sequence[StoreItem], codec: FrameCodec
               ) -> list[Result]:
    """Encode every item's row into a frame and write them as one batch; per
    item the frame bytes written, 0 if it existed, or the error.

    Where the backend checksums as it writes (``supports_crc32c``) and the
    payload is the row as is, a row whose CRC the caller did not give is
    summed by the write itself, while its bytes pass (:data:`CHECKSUM_AT`)."""
    sums = backend.supports_crc32c and codec.raw_payloads
    out: list[Result] = [TransientError("not attempted")] * len(items)
    writes: list[Write] = []
    at: list[int] = []
    for i, item in enumerate(items):
        unsummed = sums and item.crc is None
        try:
            header, payload = codec.encode(item.key, item.src, item.crc, unsummed=unsummed)
        except Exception as exc:
            out[i] = classify(exc)
            continue
        writes.append(Write(item.name, (header, payload), (1, CHECKSUM_AT) if unsummed else None))
        at.append(i)
    if writes:
        try:
            written = backend.write_many(writes)
        except Exception as exc:  # the backend broke its never-raise promise
            written = [classify(exc)] * len(writes)
        for i, res in zip(at, written, strict=True):
            out[i] = res
    return out


def load_many(backend: Backend, items: Sequence[LoadItem], codec: FrameCodec,
              mark: Mark | None = None) -> list[Result]:
    """Load every item's frame into its row; per item the frame's size or the
    error (a frame that does not check out is ObjectCorrupt: the row is then
    unusable). Sets each loaded item's ``crc``.

    ``mark`` (the load trace's, None: off) is told ``read`` as the backend's
    reads start, ``read_end`` when the first completes, and ``frame`` as each
    frame is checked."""
    if not items:
        return []
    plans = codec.plan_reads([it.key for it in items], [it.dest for it in items])
    crc_ok = backend.supports_crc32c
    reads = [Read(it.name, p.parts, p.crc_part if crc_ok else None)
             for it, p in zip(items, plans, strict=True)]
    out: list[Result] = [TransientError("no result from the backend")] * len(items)
    if mark is not None:
        mark("read")
    first = True
    pending = set(range(len(items)))
    try:
        for i, done in backend.read_many(reads):
            if i not in pending:  # not a read of this batch, or one settled already
                continue
            pending.discard(i)
            if mark is not None and first:
                mark("read_end")
                first = False
            if isinstance(done, BaseException):
                out[i] = done
                continue
            item = items[i]
            try:
                if isinstance(done, tuple):
                    placed, size, crc = done
                    # A checksum is trusted only where it was asked for.
                    crc = crc if reads[i].crc_part is not None else None
                    item.crc = plans[i].finish(placed, size, crc)
                    out[i] = size
                else:  # the whole object, as the backend's transport handed it
                    item.crc = codec.decode_into(item.key, done, item.dest).row_checksum
                    out[i] = len(done)
            except Unplanned:
                out[i] = _load_whole(backend, item, codec)
            except Exception as exc:
                out[i] = classify(exc)
            if mark is not None:
                mark("frame")
    except Exception as exc:  # the backend broke its never-raise promise
        err = classify(exc)
        for i in pending:
            out[i] = err
    return out


def _load_whole(backend: Backend, item: LoadItem, codec: FrameCodec) -> Result:
    """Read an object that did not fit its plan whole and decode it (a frame
    padded further than this tier pads its own)."""
    try:
        frame = backend.get(item.name)
        item.crc = codec.decode_into(item.key, frame, item.dest).row_checksum
        return len(frame)
    except Exception as exc:
        return classify(exc)
